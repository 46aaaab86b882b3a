#include "model/model_files.h"

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "model/gguf_file.h"
#include "model/gguf_model.h"
#include "model/packed_model.h"
#include "model/quantized_checkpoint.h"

namespace moe {

const std::vector<std::string>& ModelFiles::text_file_names() {
  static const std::vector<std::string> names = {"config.json", "tokenizer.json",
                                                 "tokenizer_config.json", "chat_template.jinja",
                                                 "generation_config.json"};
  return names;
}

Result<std::shared_ptr<ModelFiles>> ModelFiles::open(const std::string& path) {
  namespace fs = std::filesystem;
  auto files = std::make_shared<ModelFiles>();
  std::error_code ec;
  if (fs::is_directory(path, ec)) {
    auto desc = load_model_desc(path);
    if (!desc) return make_error(desc.error());
    auto ckpt = Checkpoint::open_dir(path);
    if (!ckpt) return make_error(ckpt.error());
    files->path_ = path;
    files->desc_ = std::move(*desc);
    files->ckpt_ = std::move(*ckpt);
    for (const std::string& name : text_file_names()) {
      const fs::path p = fs::path(path) / name;
      if (!fs::exists(p)) continue;
      std::ifstream in(p, std::ios::binary);
      if (!in) return make_error(p.string() + ": cannot open: " + std::strerror(errno));
      std::ostringstream ss;
      ss << in.rdbuf();
      files->text_files_[name] = ss.str();
    }
    // A GPTQ or AWQ checkpoint: experts into INT4 blobs, other quantised
    // Linears into f32 (docs/quantized-checkpoints.md).
    auto quant = read_quantization_config(files->text_files_["config.json"]);
    if (!quant) return make_error(path + "/" + quant.error());
    if (quant->has_value())
      if (Status s = QuantizedCheckpointReader::read(**quant, files.get()); !s) return make_error(s.error());
    return files;
  }
  if (!fs::exists(path, ec)) return make_error(path + ": no such file or folder");
  if (is_gguf_file(path)) return open_gguf_model(path, GgufOpenOptions{});
  if (!is_packed_model_file(path))
    return make_error(path + ": neither a checkpoint folder, a packed model file nor a GGUF file (bad magic)");
  if (Status s = PackedModelReader::read(path, files.get()); !s) return make_error(s.error());
  return files;
}

Result<std::shared_ptr<ModelFiles>> ModelFiles::from_memory(const std::string& config_json,
                                                           std::map<std::string, TensorView> tensors,
                                                           int q4_group,
                                                           std::vector<const uint8_t*> expert_blobs) {
  auto desc = parse_model_desc(config_json);
  if (!desc) return make_error(desc.error());
  auto files = std::make_shared<ModelFiles>();
  files->path_ = "<memory>";
  files->packed_ = true;  // tensors are looked up in packed_tensors_
  files->desc_ = std::move(*desc);
  files->packed_tensors_ = std::move(tensors);
  files->text_files_["config.json"] = config_json;
  if (!expert_blobs.empty()) {
    const ModelDesc& d = files->desc_;
    if (expert_blobs.size() != size_t(d.n_layers) * size_t(d.moe.n_experts))
      return make_error("from_memory: expected " + std::to_string(size_t(d.n_layers) * d.moe.n_experts) +
                        " expert blob pointers, got " + std::to_string(expert_blobs.size()));
    files->experts_q4_ = true;
    files->q4_group_ = q4_group;
    files->layout_ = moe::expert_layout(d.hidden_size, d.moe.expert_intermediate, q4_group);
    files->expert_blobs_ = std::move(expert_blobs);
  }
  return files;
}

const TensorView* ModelFiles::find(const std::string& name) const {
  if (gguf_) return gguf_->find(name);
  if (!packed_) return ckpt_.find(name);
  auto it = packed_tensors_.find(name);
  return it == packed_tensors_.end() ? nullptr : &it->second;
}

const std::map<std::string, TensorView>& ModelFiles::tensors() const {
  if (gguf_) return gguf_->tensors();
  return packed_ ? packed_tensors_ : ckpt_.tensors();
}

const uint8_t* ModelFiles::expert_q4(int layer, int expert) const {
  if (!experts_q4_ || layer < 0 || layer >= desc_.n_layers || expert < 0 ||
      expert >= desc_.moe.n_experts)
    return nullptr;
  if (gguf_) return gguf_->expert_q4(layer, expert);
  return expert_blobs_[size_t(layer) * size_t(desc_.moe.n_experts) + size_t(expert)];
}

std::string ModelFiles::tokenizer_file(const std::string& name) const {
  auto it = text_files_.find(name);
  return it == text_files_.end() ? std::string() : it->second;
}

}  // namespace moe
