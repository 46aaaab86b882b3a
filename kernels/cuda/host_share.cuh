#pragma once
// The GPU's half of a streamed pass's host share (kernels/cuda/share_slot.h):
// after a MoE layer's router, share_publish posts the layer's missed experts
// and how many of each one's intermediate rows the host computes, with the
// layer's normed state; after the GPU's own part, share_collect waits for
// the host's sum and adds it to the residual. Both read the pass number from device memory, so a decode
// graph replays them unchanged. One token (batch-1 decode).

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

// With m missed slots, the host takes rows [0, rows[m]) of each.
Status share_publish(const SharePublishArgs& a, cudaStream_t stream);

// x[hidden] += sum_host once slot->done reaches *pass; nothing when
// *host_count is 0. A host that does not answer within timeout_ms traps
// (a sticky device error: the worker reports it and is restarted).
Status share_collect(const ShareSlot* slot, const float* sum_host, float* x, int hidden, const uint32_t* pass,
                     const uint32_t* host_count, int timeout_ms, cudaStream_t stream);

}  // namespace moe::cuda
