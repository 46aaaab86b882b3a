#pragma once
// The gated MLP activation, out = silu(gate) * up (CPU twin: silu_mul in
// kernels/cpu/activation.h).

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "model/result.h"

namespace moe::cuda {

// gate, up, out: [n] f32 (out may alias gate or up).
Status silu_mul(const float* gate, const float* up, float* out, int64_t n, cudaStream_t stream);

// The fused projection's output: gate_up [rows, 2 * inter] (gate | up) f32,
// out [rows, inter] bf16 (the next projection's input).
Status silu_mul_fused(const float* gate_up, __nv_bfloat16* out, int rows, int inter, cudaStream_t stream);

}  // namespace moe::cuda
