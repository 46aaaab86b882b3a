#pragma once
// The two real MoE shapes the GPU benchmarks measure.

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
};

ModelShape qwen15_moe_a27b();
ModelShape qwen3_30b_a3b();

}  // namespace moe::bench
