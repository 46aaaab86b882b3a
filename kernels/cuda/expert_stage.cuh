#pragma once
// Layer-ahead staging of streamed experts (docs/expert-prediction.md,
// "Streamed passes"): while MoE layer L computes, the experts guessed for
// layer L+1 are copied from their mapped host blobs into staging slots in
// device memory by a few blocks on a second stream of the decode graph, and
// each is swapped into layer L+1's pointer table once it has landed. Layer
// L+1's expert kernels read a table entry once a block: the slot when the
// copy has landed, the host blob otherwise, the same bytes either way.
//
// Slots come in two halves, one for even and one for odd MoE layers: the
// copies for layer L+1 overwrite the half layer L-1 used, whose kernels have
// finished before layer L's fork point. One token a pass (batch 1): with
// several, two pairs of one expert could see it staged and not staged
// (q4_expert_gate_up's grouping reads `resident` per block).

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "model/result.h"

namespace moe::cuda {

struct StageArgs {
  const int32_t* guess_ids = nullptr;  // [top_k] the experts guessed for `layer`
  int top_k = 0;
  int n_experts = 0;
  int layer = 0;                          // the MoE layer the guesses are for
  const uint8_t** table = nullptr;        // [layers, n_experts] the pass's blob pointers (entries swapped here)
  const uint8_t* on_gpu = nullptr;        // [layers, n_experts] 1: read from device memory (not staged)
  const uint8_t* const* host_blobs = nullptr;  // [layers, n_experts] each expert's mapped host blob
  uint8_t* slots = nullptr;               // [2 * top_k, slot_bytes]
  size_t blob_bytes = 0;                  // a multiple of 16
  size_t slot_bytes = 0;                  // >= blob_bytes, a multiple of 256
  int2* staged = nullptr;                 // [2 * top_k] (layer, expert) a slot's table entry names; x < 0: none
  uint32_t* arrived = nullptr;            // [2 * top_k] blocks done copying into each slot (0 between copies)
  uint32_t* landed = nullptr;             // [1] experts staged, counted over the engine's life
  // [1] the MoE layer the compute stream has reached (copy_f32's `mark`
  // writes it as each layer forks): no expert's copy starts once the compute
  // stream has reached the copies' layer, so the side stream never falls
  // far behind.
  const int32_t* reached = nullptr;
};

// Blocks the copy takes: enough 16-byte loads in flight for the link
// (~250 KB), few enough to leave the compute stream its SMs.
constexpr int kStageBlocks = 16;

// First puts back the entries this parity's slots held (a layer two back),
// then copies each distinct guessed expert that on_gpu marks streamed into
// slot (layer & 1) * top_k + j and, once every block has copied its part,
// points the table at it. on_gpu is left alone: the host's share (posted by
// the layer's router kernel from on_gpu) takes the same rows whether a copy
// has landed or not, so outputs never depend on the copies' timing; a staged
// expert speeds up the GPU's rows of it. top_k <= 256.
Status stage_experts(const StageArgs& a, cudaStream_t stream);

// Every slot's entry back to its host blob, slots emptied: after a pass,
// so the next one starts from the tables the host uploaded.
Status restore_staged(const StageArgs& a, cudaStream_t stream);

// dst[0, n) = src[0, n) (a snapshot of the residual for the side stream),
// and *mark = mark_value when mark is set (StageArgs::reached).
Status copy_f32(const float* src, float* dst, size_t n, cudaStream_t stream, int32_t* mark = nullptr,
                int32_t mark_value = 0);

}  // namespace moe::cuda
