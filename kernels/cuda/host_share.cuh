#pragma once
// The GPU's half of a streamed pass's host share (kernels/cuda/share_slot.h):
// one warp (the MoE layer's router kernel itself at one token, given
// SharePublishArgs through router_topk, or force_experts when the
// draw replaces the router's ids; share_publish's own kernel at more)
// posts the layer's missed (token, expert) pairs and how many of each one's
// intermediate rows the host computes, with the tokens' normed states;
// after the GPU's own part, share_collect waits for the host's sums and
// adds them to the residual.
// Both read the pass number from device memory, so a decode graph replays
// them unchanged. Streamed decode passes of 1-8 tokens.

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/share_slot.h"
#include "model/result.h"

namespace moe::cuda {

struct SharePublishArgs {
  int tokens = 1;                      // the pass's tokens, at most kShareMaxTokens
  const int32_t* ids = nullptr;        // [tokens, top_k] the tokens' experts (router)
  const float* route_w = nullptr;      // [tokens, top_k]
  const uint8_t* on_gpu = nullptr;     // [n_experts] 1: read from an island this pass, 0: streamed
  const uint16_t* rows = nullptr;      // [tokens * top_k + 1] rows the host takes of each missed pair,
                                       // by how many pairs missed
  int top_k = 0, n_experts = 0, inter = 0;
  const __nv_bfloat16* xn = nullptr;   // [tokens, hidden] the experts' input
  int hidden = 0;
  ShareSlot* slot = nullptr;           // device address of the layer's mapped slot
  __nv_bfloat16* x_host = nullptr;     // device address of its mapped [tokens, hidden] states
  const uint32_t* pass = nullptr;      // this pass's number
  int32_t* gpu_ids = nullptr;          // [tokens, top_k] out: ids, -1 where the host takes the whole expert
  int32_t* gpu_split = nullptr;        // [tokens, top_k] out: the first row the GPU computes (Q4ExpertArgs::split)
  uint32_t* host_count = nullptr;      // out: pairs the host took (share_collect reads it)
};

#ifdef __CUDACC__
// Posts the pass's share (one warp, after the router wrote a.ids and
// a.route_w): with m missed (token, expert) pairs the host takes rows
// [0, rows[m]) of each. Counts the misses, writes the GPU's ids and splits
// and the slot's pairs (lane i looks at pairs i, i + 32, ...), copies the
// normed states to the host, and after a system fence the pass number into
// `posted`.
__device__ inline void share_publish_warp(const SharePublishArgs& a, int lane) {
  const int pairs = a.tokens * a.top_k;
  auto missed = [&](int i, int* e) {
    *e = i < pairs ? a.ids[i] : -1;
    return *e >= 0 && *e < a.n_experts && !a.on_gpu[*e];
  };
  int m = 0;
  for (int base = 0; base < pairs; base += 32) {
    int e;
    m += __popc(__ballot_sync(0xffffffffu, missed(base + lane, &e)));
  }
  const int rows = a.rows[m];
  const int take = rows > 0 ? m : 0;
  for (int base = 0, at = 0; base < pairs; base += 32) {
    const int i = base + lane;
    int e;
    const bool miss = missed(i, &e);  // e set for every pair, taken or not
    const bool shared = take > 0 && miss;
    const unsigned mask = __ballot_sync(0xffffffffu, shared);
    if (i < pairs) {
      a.gpu_ids[i] = shared && rows >= a.inter ? -1 : e;  // a whole expert on the host: skipped here
      a.gpu_split[i] = shared ? rows : 0;
    }
    if (shared) {
      const int j = at + __popc(mask & ((1u << lane) - 1u));  // the pairs keep their order
      a.slot->expert[j] = e;
      a.slot->token[j] = uint8_t(i / a.top_k);
      a.slot->weight[j] = a.route_w[i];
    }
    at += __popc(mask);
  }
  if (lane == 0) {
    a.slot->count = uint32_t(take);
    a.slot->rows = uint32_t(rows);
    a.slot->tokens = uint32_t(a.tokens);
    *a.host_count = uint32_t(take);
  }
  if (take > 0) {
    // 16-byte stores where the width allows (both buffers are 16-byte aligned then).
    const int n = a.tokens * a.hidden;
    const int vec = a.hidden % 8 == 0 ? n / 8 : 0;
    for (int i = lane; i < vec; i += 32) reinterpret_cast<uint4*>(a.x_host)[i] = reinterpret_cast<const uint4*>(a.xn)[i];
    for (int i = 8 * vec + lane; i < n; i += 32) a.x_host[i] = a.xn[i];
  }
  __threadfence_system();  // each lane's pairs and states reach the host before the flag
  __syncwarp();
  if (lane == 0) {
    __threadfence_system();  // and the flag's own thread releases them all
    *reinterpret_cast<volatile uint32_t*>(&a.slot->posted) = *a.pass;
  }
}
#endif

// The same as a kernel of its own (one warp), for passes of several tokens,
// whose routes come from several warps of the router.
Status share_publish(const SharePublishArgs& a, cudaStream_t stream);

// x[tokens, hidden] += sum_host once slot->done reaches *pass, and the
// first block writes slot->waited_ns (how long it waited); nothing at all
// when *host_count is 0. A host that does not answer within timeout_ms traps
// (a sticky device error: the worker reports it and is restarted).
Status share_collect(ShareSlot* slot, const float* sum_host, float* x, int tokens, int hidden, const uint32_t* pass,
                     const uint32_t* host_count, int timeout_ms, cudaStream_t stream);

}  // namespace moe::cuda
