#pragma once
// The packed model file (docs/packed-format.md): one mmap-able file holding
// the config, the tokenizer files and every tensor, each 4096-byte aligned,
// with the routed experts as INT4 blobs (docs/int4-experts.md) or as stored.
// `moe convert` writes it; ModelFiles::open reads it.

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "model/model_config.h"
#include "model/result.h"

namespace moe {

class ModelFiles;

constexpr char kPackedMagic[8] = {'M', 'O', 'E', 'P', 'A', 'C', 'K', '\0'};
constexpr uint32_t kPackedVersion = 1;
constexpr size_t kPackedPrefixBytes = 32;  // magic, version, flags, header length, data offset
constexpr size_t kPackedAlign = 4096;      // every tensor starts on a page

// The Hugging Face names of one routed expert's three matrices.
struct ExpertWeightNames {
  std::string gate, up, down;  // gate/up [inter, hidden], down [hidden, inter]
};
// Qwen/OLMoE/DeepSeek: mlp.experts.E.{gate,up,down}_proj.weight;
// Mixtral: block_sparse_moe.experts.E.{w1,w3,w2}.weight.
ExpertWeightNames expert_weight_names(const ModelDesc& d, int layer, int expert);
// The packed file's name of an INT4 expert blob: model.layers.{L}.experts.{E}.q4
std::string expert_q4_name(int layer, int expert);

struct PackOptions {
  bool quantize_experts = true;  // false: experts stay as stored (bf16)
  int group_size = 64;           // 32, 64 or 128
  int threads = 0;               // quantiser threads; 0: one per core
  // Called after each tensor is written (and once before the first, with 0s).
  std::function<void(size_t tensors_done, size_t tensors_total, uint64_t bytes_done,
                     uint64_t bytes_total)>
      progress;
};

// Packs the checkpoint folder `model_dir` into `out_path`, writing
// `out_path`.tmp first and renaming it over `out_path` only when complete.
// A GPTQ/AWQ folder's experts are INT4 already: they are written as the
// folder opens them, with its group (opts.group_size does not apply), and
// its dequantised Linears as F32.
[[nodiscard]] Status write_packed_model(const std::string& model_dir, const std::string& out_path,
                                        const PackOptions& opts);

// True when the file at `path` starts with the packed magic.
bool is_packed_model_file(const std::string& path);

// Fills a ModelFiles from a packed file (used by ModelFiles::open).
class PackedModelReader {
 public:
  [[nodiscard]] static Status read(const std::string& path, ModelFiles* out);
};

}  // namespace moe
