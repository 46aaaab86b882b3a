#pragma once
// Seeded random weights made on the GPU (no checkpoint): bf16 tensors and
// INT4 expert blobs in the layout of docs/int4-experts.md.

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "model/int4.h"
#include "model/result.h"

namespace moe::bench {

// p[i] = offset + U(-scale, scale), from (seed, i).
Status fill_bf16(__nv_bfloat16* p, size_t n, uint64_t seed, float scale, float offset, cudaStream_t stream);

// n_blobs consecutive expert blobs (stride L.blob_bytes): random codes, and
// per group scale ~ U(0.5, 1.5) * scale with bias = -7.5 * scale, so weights
// are centred on zero with a spread of about +-7.5 * scale.
Status fill_experts(uint8_t* blobs, const ExpertLayout& L, int n_blobs, uint64_t seed, float scale_in,
                    float scale_down, cudaStream_t stream);

// positions[i] += 1 (the decode loop's step, inside the graph).
Status advance_positions(int32_t* positions, int n, cudaStream_t stream);

}  // namespace moe::bench
