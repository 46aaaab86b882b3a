#pragma once
// A GGUF file (llama.cpp's format) as a ModelFiles: the architecture's
// metadata becomes the description (and a config.json text, so that every
// tool sees what a checkpoint folder gives), its tensors get their Hugging
// Face names, its tokenizer and chat template become tokenizer.json and
// tokenizer_config.json texts. Tensors are converted when first asked for:
// float tensors are views of the mapping; quantised ones are dequantised
// to f32; quantised routed experts become INT4 blobs (docs/gguf.md says
// which move losslessly and what the others cost).

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "model/gguf_file.h"
#include "model/model_files.h"
#include "model/result.h"

namespace moe {

enum class GgufExperts {
  int4,         // quantised experts become INT4 blobs (group 32): what serves
  dequantized,  // every expert dequantised to f32 by Hugging Face name (measurement only)
};

struct GgufOpenOptions {
  GgufExperts experts = GgufExperts::int4;
  int threads = 0;  // expert conversion threads; 0: one per core
};

// Opens a GGUF file with options (ModelFiles::open uses the defaults).
[[nodiscard]] Result<std::shared_ptr<ModelFiles>> open_gguf_model(const std::string& path,
                                                                  const GgufOpenOptions& opts);

// The tensors of an opened GGUF model, by Hugging Face name, each made on
// first use (thread-safe); ModelFiles routes find / tensors / expert_q4 here.
class GgufTensorSource {
 public:
  const TensorView* find(const std::string& name) const;
  // Every tensor find() can return (all made now).
  const std::map<std::string, TensorView>& tensors() const;
  const uint8_t* expert_q4(int layer, int expert) const;
  bool experts_q4() const { return experts_q4_; }

 private:
  friend class GgufModelReader;
  enum class Make {
    view,         // a float tensor of the file as it is (or one expert's slice of it)
    dequantize,   // a quantised tensor → f32
    unpermute_qk, // llama-arch q/k rows back from ggml's rope order → f32
    kv_b,         // DeepSeek-V2 kv_b_proj rebuilt from attn_k_b and attn_v_b → f32
  };
  struct Entry {
    Make make = Make::view;
    const GgufTensor* src = nullptr;
    const GgufTensor* src2 = nullptr;  // kv_b: attn_v_b
    int64_t expert = -1;               // a slice of a stacked expert tensor
    int heads = 0;                     // unpermute_qk / kv_b
    bool ready = false;
    std::vector<float> storage;
  };
  Status make(Entry& e, TensorView& v) const;
  void make_experts() const;

  std::unique_ptr<GgufFile> file_;
  ModelDesc desc_;
  int threads_ = 0;
  bool experts_q4_ = false;
  ExpertLayout layout_;
  // expert tensors of each model layer (gate, up, down), for the INT4 blobs
  struct LayerExperts {
    const GgufTensor* gate = nullptr;
    const GgufTensor* up = nullptr;
    const GgufTensor* down = nullptr;
  };
  std::vector<LayerExperts> experts_;

  mutable std::mutex mu_;
  mutable std::map<std::string, TensorView> views_;
  mutable std::map<std::string, Entry> entries_;
  // the experts' float tensors while they are served as INT4 (not in tensors())
  mutable std::map<std::string, TensorView> expert_views_;
  mutable std::map<std::string, Entry> expert_entries_;
  mutable bool all_made_ = false;
  mutable std::once_flag experts_once_;
  mutable std::vector<uint8_t> blob_storage_;
  mutable std::vector<const uint8_t*> blobs_;  // [layer * n_experts + expert]
};

class GgufModelReader {
 public:
  [[nodiscard]] static Status read(const std::string& path, const GgufOpenOptions& opts, ModelFiles* out);
};

}  // namespace moe
