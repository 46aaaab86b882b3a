#pragma once
// RMSNorm, as the CPU twin (kernels/cpu/rmsnorm.h) computes it in f32:
// y = w * x / sqrt(mean(x^2) + eps). One block per row.

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "model/result.h"

namespace moe::cuda {

// x: [rows, dim] f32, w: [dim] bf16, y: [rows, dim] (bf16 or f32).
Status rmsnorm(const float* x, const __nv_bfloat16* w, __nv_bfloat16* y, int rows, int dim, float eps,
               cudaStream_t stream);
Status rmsnorm(const float* x, const __nv_bfloat16* w, float* y, int rows, int dim, float eps,
               cudaStream_t stream);

// The step between sub-layers: residual += add (add [rows, dim], may be
// null), then y = rmsnorm(residual). residual: [rows, dim] f32, y bf16.
Status add_rmsnorm(float* residual, const float* add, const __nv_bfloat16* w, __nv_bfloat16* y, int rows,
                   int dim, float eps, cudaStream_t stream);

}  // namespace moe::cuda
