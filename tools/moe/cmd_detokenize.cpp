// moe detokenize: reads a JSON array of token ids from stdin, prints the text.

#include <cstdio>
#include <cstring>
#include <iostream>
#include <iterator>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "tools/moe/commands.h"
#include "tools/moe/load_tokenizer.h"

namespace moe::cli {

namespace {
void usage(FILE* out) {
  std::fprintf(out,
               "usage: moe detokenize --model DIR [--skip-special] < ids.json\n\n"
               "  --model DIR       a folder with tokenizer.json (and tokenizer_config.json),\n"
               "                    a GGUF file or a packed model file\n"
               "  --skip-special    leave special tokens (BOS, EOS, ...) out of the text\n");
}
}  // namespace

int cmd_detokenize(int argc, char** argv) {
  std::string model;
  bool skip_special = false;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--model") && i + 1 < argc) {
      model = argv[++i];
    } else if (!std::strcmp(argv[i], "--skip-special")) {
      skip_special = true;
    } else if (!std::strcmp(argv[i], "--help") || !std::strcmp(argv[i], "-h")) {
      usage(stdout);
      return 0;
    } else {
      std::fprintf(stderr, "moe detokenize: unexpected argument '%s'\n", argv[i]);
      usage(stderr);
      return 2;
    }
  }
  if (model.empty()) {
    usage(stderr);
    return 2;
  }
  auto tok = load_tokenizer(model);
  if (!tok) {
    std::fprintf(stderr, "moe detokenize: %s\n", tok.error().c_str());
    return 1;
  }
  std::cin >> std::noskipws;
  const std::string input((std::istreambuf_iterator<char>(std::cin)),
                          std::istreambuf_iterator<char>());
  std::vector<int32_t> ids;
  const auto j = nlohmann::json::parse(input, nullptr, /*allow_exceptions=*/false);
  if (!j.is_array()) {
    std::fprintf(stderr, "moe detokenize: stdin is not a JSON array of ids\n");
    return 1;
  }
  for (const auto& v : j) {
    if (!v.is_number_integer()) {
      std::fprintf(stderr, "moe detokenize: %s is not an integer id\n", v.dump().c_str());
      return 1;
    }
    ids.push_back(v.get<int32_t>());
  }
  const std::string text = tok.value()->decode(ids, skip_special);
  std::fwrite(text.data(), 1, text.size(), stdout);
  return 0;
}

}  // namespace moe::cli
