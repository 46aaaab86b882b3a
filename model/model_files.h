#pragma once
// A model as every engine and tool sees it: the description, the tensors, the
// INT4 expert blobs and the tokenizer files, whether it came from a Hugging
// Face checkpoint folder or from the project's packed file (`moe convert`,
// docs/packed-format.md). Everything is mapped, nothing copied, except for a
// GPTQ or AWQ checkpoint folder (docs/quantized-checkpoints.md), whose
// experts become INT4 blobs and other quantised Linears f32 at open.

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "model/int4.h"
#include "model/model_config.h"
#include "model/result.h"
#include "model/safetensors.h"

namespace moe {

class GgufTensorSource;

class ModelFiles {
 public:
  // `path`: a checkpoint folder (config.json + safetensors; a GPTQ or AWQ
  // INT4 one too), a packed file, or a GGUF file (model/gguf_model.h;
  // open_gguf_model takes options).
  static Result<std::shared_ptr<ModelFiles>> open(const std::string& path);

  // A model held in memory (benchmarks with generated weights): the
  // description from `config_json`, float tensors by Hugging Face name, and
  // INT4 expert blobs of group `q4_group` at [layer * n_experts + expert]
  // (model layers; null for dense layers). The caller keeps every buffer
  // alive as long as the ModelFiles.
  static Result<std::shared_ptr<ModelFiles>> from_memory(const std::string& config_json,
                                                         std::map<std::string, TensorView> tensors,
                                                         int q4_group,
                                                         std::vector<const uint8_t*> expert_blobs);

  const ModelDesc& desc() const { return desc_; }
  const std::string& path() const { return path_; }
  // True when the tensors are held here (a packed file, a model in memory,
  // a GPTQ/AWQ folder converted at open), not looked up in the checkpoint.
  bool is_packed() const { return packed_; }

  // A tensor by its Hugging Face name (bf16/f16/f32 as stored), nullptr if
  // absent. Where the experts are INT4 (packed file, GPTQ/AWQ folder),
  // expert matrices are not found here: use expert_q4. A GPTQ/AWQ folder's
  // other quantised Linears are found as f32 `<prefix>.weight`.
  const TensorView* find(const std::string& name) const;
  // Every tensor find() can return, by name.
  const std::map<std::string, TensorView>& tensors() const;

  // INT4 experts: present in packed files made with quantised experts and
  // in GPTQ/AWQ checkpoint folders.
  bool experts_q4() const { return experts_q4_; }
  int q4_group() const { return q4_group_; }
  const ExpertLayout& expert_layout() const { return layout_; }
  // The blob of expert `expert` of model layer `layer` (docs/int4-experts.md).
  const uint8_t* expert_q4(int layer, int expert) const;

  // Text of the tokenizer files ("" when absent): tokenizer.json,
  // tokenizer_config.json, chat_template.jinja, generation_config.json (and
  // config.json itself).
  std::string tokenizer_file(const std::string& name) const;
  // The names tokenizer_file() knows, config.json included.
  static const std::vector<std::string>& text_file_names();

 private:
  friend class PackedModelReader;
  friend class GgufModelReader;            // model/gguf_model.h
  friend class QuantizedCheckpointReader;  // model/quantized_checkpoint.h
  std::string path_;
  bool packed_ = false;
  ModelDesc desc_;
  Checkpoint ckpt_;
  std::shared_ptr<MappedFile> packed_file_;
  bool experts_q4_ = false;
  int q4_group_ = 0;
  ExpertLayout layout_;
  std::map<std::string, TensorView> packed_tensors_;
  std::vector<const uint8_t*> expert_blobs_;  // [layer * n_experts + expert]
  std::map<std::string, std::string> text_files_;
  // Heap buffers behind tensors and expert blobs that are not views of a
  // mapping (weights dequantised or re-laid out at open).
  std::vector<std::shared_ptr<const void>> owned_;
  // A GGUF model's tensors, made on first use (find, tensors, expert_q4 go there).
  std::shared_ptr<const GgufTensorSource> gguf_;
};

}  // namespace moe
