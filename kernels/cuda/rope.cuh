#pragma once
// After the q/k/v projection: optional bias, optional RMSNorm of q and k
// (per head as Qwen3-MoE, or over the whole projection as OLMoE), rotate-half
// RoPE, then q out and k/v stored into the paged pool. The CPU twins:
// rmsnorm_heads / rmsnorm (kernels/cpu/rmsnorm.h), rope_neox
// (kernels/cpu/rope.h) and kv_store (kernels/cpu/attention.h). Any even
// head_dim works (16 and 32 included).

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/attention.cuh"
#include "model/result.h"

namespace moe::cuda {

struct QkvRopeArgs {
  const float* qkv = nullptr;            // [tokens, (n_heads + 2 n_kv) * head_dim]: q | k | v
  const __nv_bfloat16* bias = nullptr;   // [(n_heads + 2 n_kv) * head_dim] or null
  // RMSNorm weights of q and k, each applied after the bias and before RoPE;
  // null: that side is not normalised. Per head (qk_norm_full_width false,
  // Qwen3-MoE): every head normalised over head_dim, weights [head_dim]
  // shared by the heads. Full width (true, OLMoE): a token's q normalised
  // over all n_heads * head_dim values, weights [n_heads * head_dim], and k
  // over n_kv * head_dim, weights [n_kv * head_dim].
  const __nv_bfloat16* q_norm = nullptr;
  const __nv_bfloat16* k_norm = nullptr;
  bool qk_norm_full_width = false;
  float eps = 1e-6f;                     // the model's rms_norm_eps, both norms
  const int32_t* positions = nullptr;    // [tokens]
  const int32_t* seq_of_token = nullptr; // [tokens]: row of the pool's block_tables
  const float* inv_freq = nullptr;       // [head_dim / 2] (the whole head rotates)
  float attention_factor = 1.f;          // cos/sin scale (1 but for YaRN)
  int tokens = 0, n_heads = 0;
  __nv_bfloat16* q_out = nullptr;        // [tokens, n_heads, head_dim]
};

Status qkv_rope_store(const QkvRopeArgs& a, const PagedKvPool& kv, cudaStream_t stream);

}  // namespace moe::cuda
