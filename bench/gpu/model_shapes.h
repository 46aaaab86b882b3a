#pragma once
// The real MoE shapes the GPU benchmarks measure.

#include <string>

namespace moe::bench {

struct ModelShape {
  std::string name;
  int hidden, layers, n_heads, n_kv, head_dim;
  int n_experts, top_k, inter;
  int shared_inter;  // 0: no shared expert; else a sigmoid-gated shared MLP
  bool qk_norm, qkv_bias, norm_topk;
  int vocab;
  float rope_theta;
  // DeepSeek-V2 (multi-head latent attention) when kv_lora_rank > 0: n_kv
  // and head_dim unused; shared_inter is its ungated shared experts' width;
  // the first first_dense layers are dense MLPs of dense_inter; YaRN RoPE.
  int kv_lora_rank = 0, qk_nope = 0, qk_rope = 0, v_head = 0;
  int first_dense = 0, dense_inter = 0;
  float yarn_factor = 0.f;
  bool mla() const { return kv_lora_rank > 0; }
};

ModelShape qwen15_moe_a27b();
ModelShape qwen3_30b_a3b();
ModelShape deepseek_v2_lite();

}  // namespace moe::bench
