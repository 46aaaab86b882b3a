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

namespace moe::cpu {

struct PagedKv {
  const float* k = nullptr;              // [pool_blocks, block_tokens, n_kv, qk_dim]
  const float* v = nullptr;              // [pool_blocks, block_tokens, n_kv, v_dim]
  const int32_t* block_table = nullptr;  // [ceil(context / block_tokens)]
  int block_tokens = 0;
};

// Writes one token's key and value into slot `pos` of a sequence.
// k: [n_kv, qk_dim], v: [n_kv, v_dim]; the pool pointers as in PagedKv.
void kv_store(float* k_pool, float* v_pool, const int32_t* block_table, int block_tokens, int pos,
              const float* k, const float* v, int n_kv, int qk_dim, int v_dim);

// out[t, h] = softmax_j(scale * q[t, h] . k[j]) v[j] over keys j <= positions[t]
// of one sequence (causal: a query sees itself and what came before).
// q: [tokens, n_heads, qk_dim] (token stride q_stride floats),
// positions: [tokens], out: [tokens, n_heads, v_dim] (token stride out_stride).
// The keys up to max(positions) must already be stored.
void attention(const float* q, int64_t q_stride, const PagedKv& kv, const int32_t* positions,
               float* out, int64_t out_stride, int tokens, int n_heads, int n_kv, int qk_dim,
               int v_dim, float scale, ThreadPool* pool);

}  // namespace moe::cpu
