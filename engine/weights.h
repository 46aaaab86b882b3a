#pragma once
// The weights of one model as the CPU engine uses them, gathered from
// ModelFiles by Hugging Face name for each of the six architectures. Float
// matrices are either converted to f32 once at load (small models: fastest)
// or read as bf16 straight from the mapped file; INT4 experts stay in their
// packed blobs.

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "kernels/cpu/thread_pool.h"
#include "model/model_files.h"
#include "model/result.h"

namespace moe {

// A linear layer W [out, in] (+ bias [out]).
struct Linear {
  int in = 0, out = 0;
  const float* f32 = nullptr;      // W as f32 (owned storage or the mapping)
  const uint16_t* bf16 = nullptr;  // W as bf16 bits in the mapping, when not converted
  std::vector<float> owned;        // storage behind f32 when converted
  std::vector<float> bias;         // [out] or empty

  bool present() const { return f32 || bf16; }
  // y[tokens, out] = x[tokens, in] W^T (+ bias). Row strides in floats.
  void apply(const float* x, int64_t x_stride, float* y, int64_t y_stride, int tokens,
             cpu::ThreadPool* pool) const;
  void apply(const float* x, float* y, int tokens, cpu::ThreadPool* pool) const {
    apply(x, in, y, out, tokens, pool);
  }
  // Row `row` of W as f32. out: [in].
  void row(int r, float* out) const;
};

// A gated MLP: down(silu(gate x) * up x).
struct Mlp {
  Linear gate, up, down;
  const uint8_t* q4 = nullptr;  // INT4 blob instead of the three matrices (routed experts)
};

struct LayerWeights {
  std::vector<float> attn_norm, mlp_norm;  // [hidden]
  // GQA attention
  Linear q, k, v, o;
  std::vector<float> q_norm, k_norm;  // [head_dim] (per head) or [heads*head_dim] (whole)
  // MLA attention (q_lora_rank > 0 uses q_a/q_b instead of q)
  Linear q_a, q_b, kv_a, kv_b;
  std::vector<float> q_a_norm, kv_a_norm;
  // Feed-forward: a dense MLP, or a router over experts (+ shared experts).
  bool moe = false;
  Mlp dense;
  Linear router;             // [n_experts, hidden]
  std::vector<Mlp> experts;  // [n_experts]
  Mlp shared;                // present when the model has shared experts
  Linear shared_gate;        // [1, hidden], Qwen2-MoE sigmoid gate of the shared expert
};

struct ModelWeights {
  Linear embed;  // [vocab, hidden], looked up by row
  std::vector<LayerWeights> layers;
  std::vector<float> final_norm;
  Linear lm_head;  // [vocab, hidden]; the embedding when tied
  bool experts_q4 = false;
  ExpertLayout q4_layout;
};

// Gathers every weight of `files`. convert_f32: copy float matrices to f32
// (otherwise bf16 matrices are read in place). use_q4: take routed experts
// from the INT4 blobs (the file must have them).
[[nodiscard]] Result<std::unique_ptr<ModelWeights>> load_weights(const ModelFiles& files,
                                                                 bool convert_f32, bool use_q4);

// Bytes the float weights take once converted to f32 (the load-time choice).
size_t f32_weight_bytes(const ModelFiles& files);

}  // namespace moe
