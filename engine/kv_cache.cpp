#include "engine/kv_cache.h"

namespace moe {

KvCache::KvCache(int n_layers, int n_blocks, int block_tokens, int n_kv, int qk_dim, int v_dim)
    : n_blocks_(n_blocks), block_tokens_(block_tokens) {
  const size_t per_block_k = size_t(block_tokens) * n_kv * qk_dim,
               per_block_v = size_t(block_tokens) * n_kv * v_dim;
  for (int l = 0; l < n_layers; ++l) {
    k_.emplace_back(new float[per_block_k * n_blocks]);
    v_.emplace_back(new float[per_block_v * n_blocks]);
  }
}

size_t KvCache::block_bytes(int n_layers, int block_tokens, int n_kv, int qk_dim, int v_dim) {
  return size_t(n_layers) * block_tokens * n_kv * (size_t(qk_dim) + v_dim) * sizeof(float);
}

}  // namespace moe
