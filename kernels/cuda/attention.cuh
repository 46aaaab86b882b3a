#pragma once
// Causal attention over a paged KV pool (the CPU twin: kernels/cpu/attention.h).
// The pool is fixed-size blocks of block_tokens slots; key j of sequence s
// lives in slot j % block_tokens of block block_tables[s, j / block_tokens].
// Each query attends to keys 0..positions[t]; decode (one query a sequence)
// and prompts (many queries of one sequence) walk the queries differently
// (AttentionWalk below).

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/kv_code.h"
#include "model/result.h"

namespace moe::cuda {

struct PagedKvPool {
  __nv_bfloat16* k = nullptr;        // [pool_blocks, block_tokens, n_kv, head_dim]
  __nv_bfloat16* v = nullptr;        // [pool_blocks, block_tokens, n_kv, head_dim]
  const int32_t* block_tables = nullptr;  // [seqs, max_blocks]
  int max_blocks = 0;                // row stride of block_tables
  int block_tokens = 0;
  int n_kv = 0, head_dim = 0;
  // Coded rows instead of k and v (docs/kv-cache.md): one byte a value,
  // one f32 scale per (slot, head).
  KvDtype dtype = KvDtype::bf16;
  uint8_t* k_codes = nullptr;        // [pool_blocks, block_tokens, n_kv, head_dim]
  uint8_t* v_codes = nullptr;
  float* k_scales = nullptr;         // [pool_blocks, block_tokens, n_kv]
  float* v_scales = nullptr;
  // Elements (codes) from a block's rows to the next block's: 0 means
  // block_tokens * n_kv * head_dim, one pool per layer as above; another
  // value lays a layer's blocks apart (blocks holding every layer's rows),
  // negative where block ids run down from the top (docs/kv-islands-trade.md).
  int64_t block_stride = 0;
  int64_t scale_block_stride = 0;    // the same for the scales (0: block_tokens * n_kv)

  // The strides in force: the ones set above, else one pool per layer's.
  __host__ __device__ int64_t block_elems() const {
    return block_stride ? block_stride : int64_t(block_tokens) * n_kv * head_dim;
  }
  __host__ __device__ int64_t block_scales() const {
    return scale_block_stride ? scale_block_stride : int64_t(block_tokens) * n_kv;
  }
};

// How the kernel walks the queries. per_query: a block per (token, head),
// its warps splitting the keys (decode: one query a sequence). query_tiles:
// on tensor cores (sm_80+), a warp per (16 consecutive tokens, head) and a
// block of four warps sharing a KV head, staging each 64-key tile of K and V
// in shared memory once for all its queries (a prompt: the keys a block
// reads serve 64 queries instead of one). Both are exact for any layout of
// tokens; tiles of many sequences' tokens walk them one run at a time, each
// over its whole context, which is slow for decode tokens (a pass of one
// prompt and some decodes keeps per_query: not split between the walks).
// automatic: query_tiles where every run of the pass is 16 tokens or more
// (and head_dim is 32, 64 or 128), else per_query.
enum class AttentionWalk { automatic, per_query, query_tiles };

// Decode attention's split runs: at least this many keys each (512, or 128
// where a pass leaves SMs idle: attention_split_keys_for), up to this many a query.
inline constexpr int kAttentionSplitKeys = 512;
inline constexpr int kAttentionSplitKeysFine = 128;
inline constexpr int kAttentionMaxSplits = 16;

struct AttentionArgs {
  const __nv_bfloat16* q = nullptr;      // [tokens, n_heads, head_dim]
  const int32_t* seq_of_token = nullptr;  // [tokens]: row of block_tables
  const int32_t* positions = nullptr;     // [tokens]
  int tokens = 0, n_heads = 0;
  float scale = 1.f;
  __nv_bfloat16* out = nullptr;           // [tokens, n_heads, head_dim]
  // Tokens in the pass's shortest run of one sequence's consecutive tokens
  // (0: not known, which keeps per_query under automatic).
  int shortest_run = 0;
  AttentionWalk walk = AttentionWalk::automatic;
  // A block per query (decode): up to `max_splits` blocks a (token, head),
  // each over a run of at least `split_keys` keys (a multiple of 32), their softmax
  // states into `partials` ([tokens, n_heads, max_splits, head_dim + 2] f32)
  // and merged, in split order, by the last block of the (token, head) to
  // finish (`split_counts`: [tokens, n_heads], zero before the first call;
  // each merge leaves its count at zero again; a grid that dies mid-way
  // leaves it short, but that error is sticky). A query of fewer than
  // 2 x split_keys keys, or max_splits 1, takes one block and writes out
  // directly.
  int max_splits = 1;
  int split_keys = kAttentionSplitKeys;
  float* partials = nullptr;
  uint32_t* split_counts = nullptr;
};

// The splits a pass whose longest query has `keys` keys is launched with:
// a function of the context's size class only (a decode graph is captured
// per class): 1 below 2 x split_keys keys (where the kernel would not
// split), else 16.
inline int attention_splits_for(int keys, int split_keys) {
  return keys < 2 * split_keys ? 1 : kAttentionMaxSplits;
}
// The split size for a decode pass of `pairs` (token, head) pairs on a
// device of `sms` multiprocessors: runs of 128+ keys where the pairs alone
// leave SMs idle (one token of 32 heads at 512 keys: 4 blocks a query, 274
// -> 338 tok/s on an H100), else 512+ (8 tokens at 2,048 keys: 16 runs of
// 128 cost 11 % against 4 of 512). docs/cuda-worker.md.
inline int attention_split_keys_for(int pairs, int sms) {
  return pairs <= sms ? kAttentionSplitKeysFine : kAttentionSplitKeys;
}
inline size_t attention_partials_floats(int tokens, int n_heads, int max_splits, int head_dim) {
  return max_splits > 1 ? size_t(tokens) * n_heads * max_splits * (head_dim + 2) : 0;
}

// True where query_tiles serves this head_dim (32, 64, 128).
bool attention_query_tiles_supported(int head_dim);

// head_dim 16, 32, 64, 128 or 256 (others are refused); n_heads a multiple of n_kv.
Status paged_attention(const AttentionArgs& a, const PagedKvPool& kv, cudaStream_t stream);

}  // namespace moe::cuda
