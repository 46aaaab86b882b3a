#pragma once
// INT4 expert matrix-vector products for decode, read straight from the
// expert blob layout of docs/int4-experts.md (model/int4.h computes it).
// All pointers are device pointers; every launcher validates its shapes and
// runs on the stream it is given.

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "model/int4.h"
#include "model/result.h"

namespace moe::cuda {

// ---- one matrix ----

// y[rows] = W x for one INT4 matrix `m` of the blob at `blob`. x: [cols].
// Tolerance against q4_matvec: activations are rounded to half inside the
// kernel (per 32-input chunk, scaled to |x| <= 1), so ~1e-3 relative.
Status q4_gemv(const uint8_t* blob, const Q4MatrixLayout& m, const float* x, float* y,
               cudaStream_t stream);
Status q4_gemv(const uint8_t* blob, const Q4MatrixLayout& m, const __nv_bfloat16* x, float* y,
               cudaStream_t stream);

// ---- routed experts (decode: every (token, slot) pair is one expert GEMV) ----

struct Q4ExpertArgs {
  ExpertLayout layout;            // the same for every expert of the layer
  const uint8_t* const* blobs;    // [n_experts] device array of device blob pointers
  int n_experts = 0;
  const int32_t* expert_ids;      // [tokens, top_k]; an id outside [0, n_experts) is skipped
  const float* route_weights;     // [tokens, top_k]
  int tokens = 0;
  int top_k = 0;
  // Optional, [tokens, top_k]: the pair's first intermediate row computed
  // here (the rows below are the host's, kernels/cuda/share_slot.h): gate/up
  // write zeros there without reading those weights, and the flat down
  // kernel skips those inputs' weights too. Null: all rows.
  const int32_t* split = nullptr;
  // gate/up at 2+ tokens: the pairs routed to one expert read its weights
  // once (one block serves them all) instead of once a pair. Pays where the
  // weights come over the link (streamed misses: batch 8 under 8 GiB, uniform
  // routing, +6 %); from device memory the kernel is not bound by the bytes
  // and grouping costs 1-3 % (batch 8, resident, or replayed routing under 8
  // GiB where most experts are hits), so resident passes leave it off and
  // `resident` ([n_experts], optional) names the experts read from device
  // memory, whose pairs stay a block each.
  bool group_pairs = false;
  const uint8_t* resident = nullptr;
};

// h[tokens*top_k, inter] = silu(gate_e x_t) * (up_e x_t) for every pair
// (t, k) with e = expert_ids[t, k]. x: [tokens, hidden].
Status q4_expert_gate_up(const Q4ExpertArgs& a, const __nv_bfloat16* x, float* h,
                         cudaStream_t stream);
Status q4_expert_gate_up(const Q4ExpertArgs& a, const float* x, float* h, cudaStream_t stream);

// out[t, hidden] (+)= sum_k route_weights[t, k] * down_e h[t*top_k + k]
// (accumulate: add to out, e.g. the residual stream; else overwrite). One
// warp sums a row over all k experts: deterministic, no atomics.
Status q4_expert_down(const Q4ExpertArgs& a, const float* h, float* out, bool accumulate,
                      cudaStream_t stream);

}  // namespace moe::cuda
