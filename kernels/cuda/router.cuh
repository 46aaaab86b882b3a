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
// Benchmark routing that replaces the router's choice of experts (the
// router still runs: its weights are kept).
//  - uniform (trace null): each token's k distinct experts drawn from a hash
//    of (seed, layer, position, sequence);
//  - replay (trace set): a recorded trace [trace_tokens][layers][k] of real
//    expert choices; the token at `position` of sequence `seq` takes row
//    (offset(seq) + position) mod trace_tokens at this layer, where offset
//    is a hash of seq, so every sequence walks the recording in order (the
//    reuse between neighbouring tokens kept) from its own place in it.
struct ForcedRouting {
  const int32_t* positions = nullptr;     // [tokens]
  const int32_t* seq_of_token = nullptr;  // [tokens]: a number that names the token's sequence
  int layer = 0;
  uint64_t seed = 0;  // uniform: any value draws (callers whose option keeps 0 for "off" skip the call)
  const int16_t* trace = nullptr;  // replay: [trace_tokens][trace_layers][k] on the device
  int trace_tokens = 0;
  int trace_layers = 0;
};

// Overwrites the ids router_topk wrote for a pass's tokens with the routing
// above, on the same stream after it; the weights stay as the router wrote
// them (slot j keeps the router's j-th weight). It reads its inputs from
// device memory, so a captured graph replays it.
// publish (at most kShareMaxTokens tokens; its ids are these ids, its
// route_w the router's weights): the same kernel then posts the pass's
// share from the forced ids, as router_topk does from its own; router_topk
// must then run without publish, or it would post the router's ids.
Status force_experts(const ForcedRouting& route, int32_t* ids, int tokens, int n_experts, int top_k,
                     cudaStream_t stream, const SharePublishArgs* publish = nullptr);

// Benchmarks with replayed routing: guesses for MoE layer route.layer (the
// next one) as good as a real router's, which the seeded weights cannot
// give while the trace fixes the ids: each of the token's recorded experts
// at that layer kept with chance `recall` (a hash of the seed, the layer,
// the position and the slot) and replaced by a drawn expert otherwise.
Status force_guess(const ForcedRouting& route, float recall, int32_t* ids, int tokens, int n_experts, int top_k,
                   cudaStream_t stream);

// The trace row a replayed token takes (host side of the rule above, for
// tests and tools).
int replay_row(int32_t seq, int32_t position, int trace_tokens);

}  // namespace moe::cuda
