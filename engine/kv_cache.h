#pragma once
// The KV cache: per layer, one pool of fixed-size blocks for keys and one for
// values; a sequence owns a list of blocks (its block table, handed out by
// the engine's KvBlockPool, engine/kv_block_pool.h). Capacity is
// counted in blocks so the scheduler can reason about it; running out is an
// error the caller handles (by preempting), never an allocation. Rows are
// f32, or one-byte codes with a scale per row (docs/kv-cache.md).
//
// Not thread-safe: owned by one engine, used from its calling thread.

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "kernels/cpu/attention.h"
#include "kernels/kv_code.h"

namespace moe {

class KvCache {
 public:
  // Per token and layer: n_kv heads of qk_dim key values and v_dim values.
  KvCache(int n_layers, int n_blocks, int block_tokens, int n_kv, int qk_dim, int v_dim,
          KvDtype dtype = KvDtype::bf16);

  // Bytes one block takes over all layers (keys and values).
  static size_t block_bytes(int n_layers, int block_tokens, int n_kv, int qk_dim, int v_dim,
                            KvDtype dtype = KvDtype::bf16);

  int blocks_total() const { return n_blocks_; }
  int block_tokens() const { return block_tokens_; }
  KvDtype dtype() const { return dtype_; }

  // One layer's pools, for the kernels.
  cpu::KvRows rows(int layer);

 private:
  int n_blocks_, block_tokens_;
  KvDtype dtype_;
  // Uninitialised on purpose: pages are touched only when blocks are used.
  std::vector<std::unique_ptr<float[]>> k_, v_;          // f32 rows, or the scales of coded ones
  std::vector<std::unique_ptr<uint8_t[]>> kc_, vc_;      // coded rows
};

}  // namespace moe
