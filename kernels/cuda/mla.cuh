#pragma once
// Multi-head latent attention (DeepSeek-V2, docs/cuda-mla.md), absorbed:
// the KV cache holds per token one row of the normed latent (kv_lora_rank
// values) then the rotated key every head shares (qk_rope_head_dim values);
// W_UK is folded into the query, scores and values are taken against the
// latent rows, and W_UV takes the output out of latent space.
//   mla_rope_store   kv_a's latent normed and its key rotated into the pool,
//                    q's no-RoPE part out, its RoPE part rotated into q_abs
//   head_gemv        per-head matrices: q_abs's latent part = W_UK^hT q_nope^h,
//                    and attn^h = W_UV^h o_lat^h
//   mla_attention    causal attention of q_abs over the latent rows
// The CPU twin is the expanded form (ForwardPass::attention_mla): the
// kernels' test compares them.

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "model/result.h"

namespace moe::cuda {

// Per layer: [pool_blocks, block_tokens, rank + rope] bf16 rows.
struct PagedLatentPool {
  __nv_bfloat16* rows = nullptr;
  const int32_t* block_tables = nullptr;  // [seqs, max_blocks]
  int max_blocks = 0;                     // row stride of block_tables
  int block_tokens = 0;
  int rank = 0, rope = 0;                 // a row is rank + rope values
  // Elements from a block's rows to the next block's; 0: block_tokens *
  // (rank + rope). Negative where block ids run down (docs/kv-islands-trade.md).
  int64_t block_stride = 0;
};

// The (rank, rope) pairs the attention kernel is compiled for: every
// published DeepSeek-V2 / V2-Lite / V2.5 (512, 64) and the test fixture's
// (32, 8). Others are refused.
bool mla_shape_supported(int rank, int rope);

struct MlaRopeArgs {
  // [tokens, row_stride]: q (n_heads * (nope + rope)) then kv_a (rank + rope).
  const float* proj = nullptr;
  int row_stride = 0;
  const __nv_bfloat16* kv_a_norm = nullptr;  // [rank]
  float eps = 1e-6f;
  const int32_t* positions = nullptr;     // [tokens]
  const int32_t* seq_of_token = nullptr;  // [tokens]
  const float* inv_freq = nullptr;        // [rope / 2]
  float attention_factor = 1.f;           // cos / sin scale (YaRN)
  int tokens = 0, n_heads = 0, nope = 0;
  __nv_bfloat16* q_nope = nullptr;        // [tokens, n_heads, nope]
  __nv_bfloat16* q_abs = nullptr;         // [tokens, n_heads, rank + rope]: the RoPE part written here
};

// Interleaved RoPE (pairs 2i, 2i + 1), as cpu::rope_interleaved.
Status mla_rope_store(const MlaRopeArgs& a, const PagedLatentPool& pool, cudaStream_t stream);

struct HeadGemvArgs {
  // groups matrices of rows x cols, stacked: w[g * rows + r][c].
  const __nv_bfloat16* w = nullptr;
  int groups = 0, rows = 0, cols = 0;
  // x[t * x_token_stride + g * x_group_stride + c]
  const __nv_bfloat16* x = nullptr;
  int64_t x_token_stride = 0, x_group_stride = 0;
  // out[t * out_token_stride + g * out_group_stride + r] (bf16)
  __nv_bfloat16* out = nullptr;
  int64_t out_token_stride = 0, out_group_stride = 0;
  int tokens = 0;
};

// cols even and at most 1,024.
Status head_gemv(const HeadGemvArgs& a, cudaStream_t stream);

struct MlaAttentionArgs {
  const __nv_bfloat16* q_abs = nullptr;   // [tokens, n_heads, rank + rope]
  const int32_t* seq_of_token = nullptr;  // [tokens]: row of block_tables
  const int32_t* positions = nullptr;     // [tokens]: each attends to keys 0..positions[t]
  int tokens = 0, n_heads = 0;
  float scale = 1.f;
  __nv_bfloat16* out = nullptr;           // [tokens, n_heads, rank]: sum_j p_j latent_j
  // Each (token, head) split over `splits` runs of keys (whole
  // tiles of 32), each its softmax state into `partials` ([tokens,
  // n_heads, splits, rank + 2] f32: max, sum, then the rank outputs), a
  // second kernel merging them into out. 1: one block a (token, head), out
  // written directly.
  int splits = 1;
  float* partials = nullptr;
};

inline constexpr int kMlaMaxSplits = 16;

// Heads of one token a block takes: 4 in passes of more than 8 tokens
// (each latent row loaded once for the 4), else 1 (more blocks for decode).
inline int mla_heads_per_block(int tokens, int n_heads) { return tokens > 8 && n_heads % 4 == 0 ? 4 : 1; }

// Splits for a pass of `tokens` query tokens: about 512 blocks (four a
// multiprocessor on an H200), as far as 16 splits go; a function of the
// pass's size only, so that a captured decode graph stays valid as contexts
// grow. Long prefill passes take one.
inline int mla_splits(int tokens, int n_heads) {
  const int blocks = tokens * (n_heads / mla_heads_per_block(tokens, n_heads));
  const int s = 512 / (blocks > 0 ? blocks : 1);
  return s < 1 ? 1 : (s > kMlaMaxSplits ? kMlaMaxSplits : s);
}

// Floats of `partials` a pass of `tokens` needs (0 with one split).
inline size_t mla_partials_floats(int tokens, int n_heads, int splits, int rank) {
  return splits > 1 ? size_t(tokens) * n_heads * splits * (rank + 2) : 0;
}

Status mla_attention(const MlaAttentionArgs& a, const PagedLatentPool& pool, cudaStream_t stream);

}  // namespace moe::cuda
