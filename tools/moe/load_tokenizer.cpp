#include "tools/moe/load_tokenizer.h"

#include <filesystem>
#include <fstream>
#include <iterator>

#include "model/model_files.h"

namespace moe::cli {

Result<std::unique_ptr<Tokenizer>> load_tokenizer(const std::string& path) {
  std::error_code ec;
  // A folder may hold only the tokenizer files, without any weights.
  if (std::filesystem::is_directory(path, ec)) return Tokenizer::load_dir(path);
  auto files = ModelFiles::open(path);
  if (!files) return make_error(path + ": " + files.error());
  const std::string tj = files.value()->tokenizer_file("tokenizer.json");
  if (tj.empty()) return make_error(path + ": holds no tokenizer.json");
  return Tokenizer::from_json(tj, files.value()->tokenizer_file("tokenizer_config.json"));
}

Result<std::vector<int32_t>> text_file_ids(const std::string& model, const std::string& file) {
  std::ifstream in(file, std::ios::binary);
  if (!in) return make_error("cannot read " + file);
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  auto tok = load_tokenizer(model);
  if (!tok) return make_error(tok.error());
  return tok.value()->encode(text, /*add_special_tokens=*/true);
}

}  // namespace moe::cli
