#pragma once
// A whole MoE decoder on one GPU with seeded random weights, for timing:
// experts INT4 (group 64) in the blob layout, everything else bf16, KV in a
// paged bf16 pool. decode_step() is graph-capturable (no host sync, no
// allocation); prefill() runs one prompt through cuBLASLt and the grouped
// INT4 GEMM.

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "bench/gpu/model_shapes.h"
#include "kernels/cuda/attention.cuh"
#include "kernels/cuda/dense_matmul.cuh"
#include "model/int4.h"
#include "model/result.h"

namespace moe::bench {

// Where a layer's expert kernels find their blobs when the experts are not
// all resident (budget modes): called at the layer's router point.
struct ExpertBinding {
  const uint8_t* const* blobs = nullptr;  // [n_experts] device table of device blobs
  const int32_t* ids = nullptr;           // [tokens, top_k] device expert ids
};
class ExpertProvider {
 public:
  virtual ~ExpertProvider() = default;
  virtual Result<ExpertBinding> bind(int layer, int tokens, cudaStream_t st) = 0;
  // The layer's expert kernels are enqueued: its islands may be reused after them.
  virtual Status unbind(int layer, cudaStream_t st) = 0;
};

// Bytes of weights one decode step reads for `tokens` tokens when each token
// routes to top_k distinct experts (no sharing between tokens counted).
double decode_bytes_per_step(const ModelShape& s, const ExpertLayout& L, int tokens);

class BenchModel {
 public:
  // Allocates and fills everything for up to max_tokens tokens per call and
  // max_seqs sequences of up to max_context positions.
  static Result<std::unique_ptr<BenchModel>> create(const ModelShape& s, int max_tokens,
                                                    int max_seqs, int max_context, uint64_t seed,
                                                    cudaStream_t stream,
                                                    uint8_t* host_experts = nullptr);
  // host_experts non-null: the experts are made into that host buffer
  // ([layers * n_experts * blob_bytes]) instead of device memory, and every
  // step needs an ExpertProvider (set_provider) to find them.
  void set_provider(ExpertProvider* p) { provider_ = p; }
  const ModelShape& shape() const { return s_; }
  ~BenchModel();

  // One decode step for `batch` sequences (<= 8): reads tokens_ / positions_
  // (device), writes the greedy next tokens back to tokens_ and advances
  // positions_ by one.
  Status decode_step(int batch, cudaStream_t stream);

  // One prompt of n tokens (sequence 0, positions 0..n-1); the last token's
  // greedy next token lands in tokens_[0].
  Status prefill(int n, cudaStream_t stream);

  // Batches up to this size fold RMSNorm / SiLU into the GEMVs' staging.
  void set_fuse_max_batch(int b) { fuse_max_batch_ = b; }

  // Sets every sequence's next position (host -> device, synchronous).
  Status set_positions(int first_position, int batch);

  // Isolated kernel timings (graph replays over all layers, so that weights
  // come from DRAM, not L2): time per call, bytes moved, flops.
  struct KernelTiming {
    std::string name;
    double us = 0, bytes = 0, flops = 0;
  };
  Result<std::vector<KernelTiming>> time_kernels(cudaStream_t stream);

  const ExpertLayout& layout() const { return layout_; }
  int32_t* tokens() { return tokens_; }

 private:
  BenchModel() = default;
  Status alloc(void** p, size_t bytes);

  ModelShape s_{};
  ExpertLayout layout_{};
  int max_tokens_ = 0, max_seqs_ = 0, max_blocks_ = 0;
  int fuse_max_batch_ = 4;
  ExpertProvider* provider_ = nullptr;
  // With a provider: layer l+1's router applied to layer l's normed state,
  // the prediction a real worker prefetches from (computed for its cost).
  Status predict_next(int layer, int tokens, cudaStream_t st);
  std::vector<void*> allocations_;
  std::unique_ptr<cuda::CublasLtMatmul> mm_;

  struct Layer {
    __nv_bfloat16 *in_norm, *post_norm, *qkv_w, *qkv_b, *q_norm, *k_norm, *o_w, *router_w;
    // shared_w: [2 SI + 1 + n_experts (padded to 8), hidden]: shared gate, shared up,
    // the shared gate logit and the router, one projection of the normed state.
    __nv_bfloat16 *shared_w, *shared_down;
    uint8_t* experts;             // [n_experts * blob_bytes]
    const uint8_t** expert_ptrs;  // [n_experts] device
    __nv_bfloat16 *k_pool, *v_pool;
  };
  std::vector<Layer> layers_;
  __nv_bfloat16 *embed_ = nullptr, *final_norm_ = nullptr, *lm_head_ = nullptr;
  float* inv_freq_ = nullptr;
  int32_t *block_tables_ = nullptr, *seq_of_token_ = nullptr, *prefill_seq_ = nullptr;
  int32_t *positions_ = nullptr, *prefill_pos_ = nullptr, *tokens_ = nullptr, *prompt_ = nullptr;
  // activations, sized for max_tokens
  float *x_ = nullptr, *qkv_ = nullptr, *logits_ = nullptr, *router_logits_ = nullptr,
        *h_ = nullptr;
  float *shared_gu_ = nullptr, *tmp_ = nullptr, *route_w_ = nullptr;
  int32_t* route_ids_ = nullptr;
  __nv_bfloat16 *xn_ = nullptr, *q_ = nullptr, *attn_ = nullptr, *shared_h_ = nullptr;
  void* grouped_ws_ = nullptr;
  size_t grouped_ws_bytes_ = 0;
};

}  // namespace moe::bench
