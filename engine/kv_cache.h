#pragma once
// The KV cache: per layer, one pool of fixed-size blocks for keys and one for
// values; a sequence owns a list of blocks (its block table, handed out by
// the engine's KvBlockPool, engine/kv_block_pool.h). Capacity is
// counted in blocks so the scheduler can reason about it; running out is an
// error the caller handles (by preempting), never an allocation.
//
// Not thread-safe: owned by one engine, used from its calling thread.

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

namespace moe {

class KvCache {
 public:
  // Per token and layer: n_kv heads of qk_dim key values and v_dim values.
  KvCache(int n_layers, int n_blocks, int block_tokens, int n_kv, int qk_dim, int v_dim);

  // Bytes one block takes over all layers (keys and values, f32).
  static size_t block_bytes(int n_layers, int block_tokens, int n_kv, int qk_dim, int v_dim);

  int blocks_total() const { return n_blocks_; }
  int block_tokens() const { return block_tokens_; }

  float* k(int layer) { return k_[size_t(layer)].get(); }  // [n_blocks, block_tokens, n_kv, qk_dim]
  float* v(int layer) { return v_[size_t(layer)].get(); }  // [n_blocks, block_tokens, n_kv, v_dim]

 private:
  int n_blocks_, block_tokens_;
  // Uninitialised on purpose: pages are touched only when blocks are used.
  std::vector<std::unique_ptr<float[]>> k_, v_;
};

}  // namespace moe
