#pragma once
// Causal attention of query tokens over a paged KV cache.
//
// The cache is a pool of fixed-size blocks; a sequence owns a list of blocks
// (its block table), and key j of the sequence lives in slot j % block_tokens
// of block block_table[j / block_tokens]. A contiguous cache is the special
// case of one block as long as the context (block_table = {0}).
//
// Grouped-query attention: query head h reads KV head h / (n_heads / n_kv).

#include <cstdint>

#include "kernels/cpu/thread_pool.h"
#include "kernels/kv_code.h"

namespace moe::cpu {

// One layer's K and V pools: f32 rows (KvDtype::bf16), or one-byte codes
// with a scale per row (int8, fp8; docs/kv-cache.md).
struct KvRows {
  KvDtype dtype = KvDtype::bf16;
  float* k = nullptr;         // [pool_blocks, block_tokens, n_kv, qk_dim] (bf16)
  float* v = nullptr;         // [pool_blocks, block_tokens, n_kv, v_dim]
  uint8_t* k_codes = nullptr;  // the same shapes, one byte a value (int8, fp8)
  uint8_t* v_codes = nullptr;
  float* k_scales = nullptr;  // [pool_blocks, block_tokens, n_kv]
  float* v_scales = nullptr;
};

struct PagedKv {
  const float* k = nullptr;              // [pool_blocks, block_tokens, n_kv, qk_dim]
  const float* v = nullptr;              // [pool_blocks, block_tokens, n_kv, v_dim]
  const int32_t* block_table = nullptr;  // [ceil(context / block_tokens)]
  int block_tokens = 0;
  // Coded rows instead of k and v (dtype int8 or fp8).
  KvDtype dtype = KvDtype::bf16;
  const uint8_t* k_codes = nullptr;
  const uint8_t* v_codes = nullptr;
  const float* k_scales = nullptr;
  const float* v_scales = nullptr;
};

// Writes one token's key and value into slot `pos` of a sequence.
// k: [n_kv, qk_dim], v: [n_kv, v_dim]; the pool pointers as in PagedKv.
void kv_store(float* k_pool, float* v_pool, const int32_t* block_table, int block_tokens, int pos,
              const float* k, const float* v, int n_kv, int qk_dim, int v_dim);
// The same into either kind of pool: coded rows are encoded here, one scale
// per head (kv_encode_row).
void kv_store(const KvRows& pool, const int32_t* block_table, int block_tokens, int pos, const float* k,
              const float* v, int n_kv, int qk_dim, int v_dim);

// out[t, h] = softmax_j(scale * q[t, h] . k[j]) v[j] over keys j <= positions[t]
// of one sequence (causal: a query sees itself and what came before).
// q: [tokens, n_heads, qk_dim] (token stride q_stride floats),
// positions: [tokens], out: [tokens, n_heads, v_dim] (token stride out_stride).
// The keys up to max(positions) must already be stored.
void attention(const float* q, int64_t q_stride, const PagedKv& kv, const int32_t* positions,
               float* out, int64_t out_stride, int tokens, int n_heads, int n_kv, int qk_dim,
               int v_dim, float scale, ThreadPool* pool);

}  // namespace moe::cpu
