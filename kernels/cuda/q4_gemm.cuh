#pragma once
// Grouped INT4 expert GEMM for batches and prefill: every expert processes
// all the tokens routed to it in one pass, on tensor cores (the INT4 codes
// are staged in shared memory and dequantised to bf16 in registers, tokens
// are gathered by index). The CPU twin: per token, q4_matvec of gate/up/down
// (model/int4.h) and silu_mul.

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/q4_gemv.cuh"
#include "model/result.h"

namespace moe::cuda {

// Scratch the grouped path needs for `tokens` x `top_k` pairs.
size_t q4_grouped_workspace_bytes(const ExpertLayout& layout, int tokens, int top_k, int n_experts);

// True when the grouped kernels take this layout (hidden and inter multiples
// of 64, group a multiple of 32); otherwise callers use the GEMV path.
bool q4_grouped_supported(const ExpertLayout& layout);

// out[t, hidden] += sum_k w[t, k] * down_e(silu(gate_e x_t) * up_e x_t).
// x: [tokens, hidden] bf16; out: [tokens, hidden] f32 (the residual stream);
// workspace: q4_grouped_workspace_bytes() bytes of device memory.
// Rounding: x and the gate/up product go through bf16 (tensor-core inputs).
Status q4_grouped_moe(const Q4ExpertArgs& a, const __nv_bfloat16* x, float* out, void* workspace,
                      size_t workspace_bytes, cudaStream_t stream);

}  // namespace moe::cuda
