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

// Benchmarks only (seed 0: off): each token's expert ids drawn uniformly,
// as uniform_route below, inside router_topk (no launch of its own).
struct UniformDraw {
  const int32_t* positions = nullptr;     // [tokens]
  const int32_t* seq_of_token = nullptr;  // [tokens]
  int layer = 0;
  uint64_t seed = 0;
};

// logits: [tokens, logits_stride >= n_experts] f32 (0: n_experts; a wider
// row lets the router share a projection with other outputs);
// ids, weights: [tokens, top_k]. n_experts <= 1024, top_k <= n_experts.
// publish (one token; its ids and route_w are these ids and weights): the
// same kernel then posts the token's share for the host's cores
// (kernels/cuda/host_share.cuh), with no launch of its own.
Status router_topk(const float* logits, int tokens, int n_experts, int top_k, bool renormalize, float scale,
                   int32_t* ids, float* weights, cudaStream_t stream, int logits_stride = 0,
                   const UniformDraw& draw = {}, const SharePublishArgs* publish = nullptr);

// Benchmarks only: replaces each token's expert ids with top_k distinct
// experts drawn uniformly from a hash of (seed, layer, positions[t],
// seq_of_token[t]), keeping the router's weights. Deterministic, and it
// reads its inputs from device memory, so a captured graph replays it.
// This is the "uniform routing" load the offload targets are stated for.
Status uniform_route(int32_t* ids, int tokens, int n_experts, int top_k, const int32_t* positions,
                     const int32_t* seq_of_token, int layer, uint64_t seed, cudaStream_t stream);

}  // namespace moe::cuda
