#pragma once
// The GPU's half of a streamed pass's host share (kernels/cuda/share_slot.h):
// the MoE layer's router kernel, given SharePublishArgs (router_topk), posts
// the layer's missed experts and how many of each one's intermediate rows
// the host computes, with the layer's normed state; after the GPU's own
// part, share_collect waits for the host's sum and adds it to the residual.
// Both read the pass number from device memory, so a decode graph replays
// them unchanged. One token (batch-1 decode).

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/share_slot.h"
#include "model/result.h"

namespace moe::cuda {

struct SharePublishArgs {
  const int32_t* ids = nullptr;        // [top_k] the token's experts (router)
  const float* route_w = nullptr;      // [top_k]
  const uint8_t* on_gpu = nullptr;     // [n_experts] 1: read from an island this pass, 0: streamed
  const uint16_t* rows = nullptr;      // [top_k + 1] rows the host takes of each miss, by how many missed
  int top_k = 0, n_experts = 0, inter = 0;
  const __nv_bfloat16* xn = nullptr;   // [hidden] the experts' input
  int hidden = 0;
  ShareSlot* slot = nullptr;           // device address of the layer's mapped slot
  __nv_bfloat16* x_host = nullptr;     // device address of its mapped [hidden] state
  const uint32_t* pass = nullptr;      // this pass's number
  int32_t* gpu_ids = nullptr;          // [top_k] out: ids, -1 where the host takes the whole expert
  int32_t* gpu_split = nullptr;        // [top_k] out: the first row the GPU computes (Q4ExpertArgs::split)
  uint32_t* host_count = nullptr;      // out: pairs the host took (share_collect reads it)
};

#ifdef __CUDACC__
// Posts the token's share (one warp, after the router wrote a.ids and
// a.route_w): with m missed slots the host takes rows [0, rows[m]) of each.
// Counts the misses, writes the GPU's ids and splits and the slot's pairs,
// copies the normed state to the host, and after a system fence the pass
// number into `posted`.
__device__ inline void share_publish_warp(const SharePublishArgs& a, int lane) {
  int take = 0;
  if (lane == 0) {
    int m = 0;
    for (int k = 0; k < a.top_k; ++k) {
      const int e = a.ids[k];
      m += e >= 0 && e < a.n_experts && !a.on_gpu[e];
    }
    const int rows = a.rows[m];
    take = rows > 0 ? m : 0;
    int i = 0;
    for (int k = 0; k < a.top_k; ++k) {
      const int e = a.ids[k];
      const bool shared = take > 0 && e >= 0 && e < a.n_experts && !a.on_gpu[e];
      a.gpu_ids[k] = shared && rows >= a.inter ? -1 : e;  // a whole expert on the host: skipped here
      a.gpu_split[k] = shared ? rows : 0;
      if (shared) {
        a.slot->expert[i] = e;
        a.slot->weight[i] = a.route_w[k];
        ++i;
      }
    }
    a.slot->count = uint32_t(take);
    a.slot->rows = uint32_t(rows);
    *a.host_count = uint32_t(take);
  }
  take = __shfl_sync(0xffffffffu, take, 0);
  if (take > 0) {
    // 16-byte stores where the width allows (both buffers are 16-byte aligned then).
    const int vec = a.hidden % 8 == 0 ? a.hidden / 8 : 0;
    for (int i = lane; i < vec; i += 32) reinterpret_cast<uint4*>(a.x_host)[i] = reinterpret_cast<const uint4*>(a.xn)[i];
    for (int i = 8 * vec + lane; i < a.hidden; i += 32) a.x_host[i] = a.xn[i];
  }
  __syncwarp();
  if (lane == 0) {
    __threadfence_system();  // the pairs and the state reach the host before the flag
    *reinterpret_cast<volatile uint32_t*>(&a.slot->posted) = *a.pass;
  }
}
#endif

// x[hidden] += sum_host once slot->done reaches *pass; nothing when
// *host_count is 0; the first block then writes slot->waited_ns (how long
// it waited). A host that does not answer within timeout_ms traps
// (a sticky device error: the worker reports it and is restarted).
Status share_collect(ShareSlot* slot, const float* sum_host, float* x, int hidden, const uint32_t* pass,
                     const uint32_t* host_count, int timeout_ms, cudaStream_t stream);

}  // namespace moe::cuda
