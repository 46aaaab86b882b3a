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

// The fused projection's output: gate_up [rows, in_stride >= 2 * inter]
// (gate | up | anything) f32, out [rows, inter] bf16 (the next projection's
// input). in_stride 0 means 2 * inter.
Status silu_mul_fused(const float* gate_up, __nv_bfloat16* out, int rows, int inter, cudaStream_t stream,
                      int in_stride = 0);

// x[r, :] += sigmoid(gate_logits[r * gate_stride]) * y[r, :] (the Qwen2-MoE
// shared expert's gate). x, y: [rows, n] f32.
Status gated_add(float* x, const float* y, const float* gate_logits, int gate_stride, int rows, int n,
                 cudaStream_t stream);

// x[i] += y[i] for i < n (experts computed on the host, added to the
// residual stream).
Status add_inplace(float* x, const float* y, int64_t n, cudaStream_t stream);

}  // namespace moe::cuda
