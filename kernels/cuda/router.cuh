#pragma once
// MoE routing: softmax over each token's router logits, then its top-k
// experts (best first, equal scores keep the lower index first), weights
// optionally renormalised to sum to 1 and scaled. CPU twin: router_topk in
// kernels/cpu/router.h (group-limited selection is not implemented here).

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/host_share.cuh"
#include "model/result.h"

namespace moe::cuda {

// logits: [tokens, logits_stride >= n_experts] f32 (0: n_experts; a wider
// row lets the router share a projection with other outputs);
// ids, weights: [tokens, top_k]. n_experts <= 1024, top_k <= n_experts.
// publish (one token; its ids and route_w are these ids and weights): the
// same kernel then posts the token's share for the host's cores
// (kernels/cuda/host_share.cuh), with no launch of its own.
Status router_topk(const float* logits, int tokens, int n_experts, int top_k, bool renormalize, float scale,
                   int32_t* ids, float* weights, cudaStream_t stream, int logits_stride = 0,
                   const SharePublishArgs* publish = nullptr);

// Benchmarks only: "uniform routing", the load the offload targets are
// stated for, where no expert is more popular than another. Token t's
// top_k distinct experts are drawn from a hash of (seed, layer,
// positions[t], seq_of_token[t]); the same inputs always give the same ids.
struct UniformDraw {
  const int32_t* positions = nullptr;     // [tokens]
  const int32_t* seq_of_token = nullptr;  // [tokens]
  int layer = 0;
  uint64_t seed = 0;  // any value draws (callers whose option keeps 0 for "off" skip the call)
};

// Overwrites the ids router_topk wrote for a pass's tokens with the draw
// above, on the same stream after it; the weights stay as the router wrote
// them (slot j keeps the router's j-th weight). It reads its inputs from
// device memory, so a captured graph replays it.
// publish (at most kShareMaxTokens tokens; its ids are these ids, its
// route_w the router's weights): the same kernel then posts the pass's
// share from the drawn ids, as router_topk does from its own; router_topk
// must then run without publish, or it would post the router's ids.
Status draw_uniform_experts(const UniformDraw& draw, int32_t* ids, int tokens, int n_experts, int top_k,
                            cudaStream_t stream, const SharePublishArgs* publish = nullptr);

}  // namespace moe::cuda
