#include "engine/kv_cache.h"

namespace moe {

KvCache::KvCache(int n_layers, int n_blocks, int block_tokens, int n_kv, int qk_dim, int v_dim, KvDtype dtype)
    : n_blocks_(n_blocks), block_tokens_(block_tokens), dtype_(dtype) {
  const size_t rows = size_t(n_blocks) * block_tokens * n_kv;
  for (int l = 0; l < n_layers; ++l) {
    if (kv_coded(dtype)) {
      kc_.emplace_back(new uint8_t[rows * qk_dim]);
      vc_.emplace_back(new uint8_t[rows * v_dim]);
      k_.emplace_back(new float[rows]);
      v_.emplace_back(new float[rows]);
    } else {
      k_.emplace_back(new float[rows * qk_dim]);
      v_.emplace_back(new float[rows * v_dim]);
    }
  }
}

size_t KvCache::block_bytes(int n_layers, int block_tokens, int n_kv, int qk_dim, int v_dim, KvDtype dtype) {
  const size_t rows = size_t(n_layers) * block_tokens * n_kv;
  if (kv_coded(dtype)) return rows * (size_t(qk_dim) + v_dim + 2 * sizeof(float));
  return rows * (size_t(qk_dim) + v_dim) * sizeof(float);
}

cpu::KvRows KvCache::rows(int layer) {
  cpu::KvRows r;
  r.dtype = dtype_;
  const size_t l = size_t(layer);
  if (kv_coded(dtype_)) {
    r.k_codes = kc_[l].get();
    r.v_codes = vc_[l].get();
    r.k_scales = k_[l].get();
    r.v_scales = v_[l].get();
  } else {
    r.k = k_[l].get();
    r.v = v_[l].get();
  }
  return r;
}

}  // namespace moe
