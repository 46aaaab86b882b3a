#include "kernels/cuda/activation.cuh"
#include "kernels/cuda/cuda_check.cuh"
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/device_math.cuh"

namespace moe::cuda {
namespace {

__global__ void silu_mul_kernel(const float* g, const float* u, float* o, int64_t n) {
  detail::allow_next_grid();
  detail::wait_prior_grid();
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    o[i] = detail::silu(g[i]) * u[i];
}

__global__ void silu_mul_fused_kernel(const float* gu, __nv_bfloat16* o, int rows, int inter, int stride) {
  detail::allow_next_grid();
  detail::wait_prior_grid();
  const int64_t n = int64_t(rows) * inter;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = i / inter, c = i % inter;
    const float* row = gu + r * stride;
    o[i] = __float2bfloat16(detail::silu(row[c]) * row[inter + c]);
  }
}

__global__ void gated_add_kernel(float* x, const float* y, const float* g, int gs, int rows, int n) {
  detail::allow_next_grid();
  detail::wait_prior_grid();
  const int64_t total = int64_t(rows) * n;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total;
       i += int64_t(gridDim.x) * blockDim.x)
    x[i] += detail::sigmoid(g[(i / n) * gs]) * y[i];
}

__global__ void add_kernel(float* x, const float* y, int64_t n) {
  detail::allow_next_grid();
  detail::wait_prior_grid();
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    x[i] += y[i];
}

int blocks_for(int64_t n) { return int(std::min<int64_t>((n + 255) / 256, 4096)); }

}  // namespace

Status silu_mul(const float* gate, const float* up, float* out, int64_t n, cudaStream_t stream) {
  MOE_CUDA_REQUIRE(gate && up && out && n > 0, "null pointer or empty");
  MOE_CUDA_TRY(detail::launch_pdl(silu_mul_kernel, dim3(blocks_for(n)), dim3(256), 0, stream, gate, up, out, n));
  MOE_CUDA_LAUNCHED();
  return {};
}

Status silu_mul_fused(const float* gate_up, __nv_bfloat16* out, int rows, int inter, cudaStream_t stream,
                      int in_stride) {
  MOE_CUDA_REQUIRE(gate_up && out && rows > 0 && inter > 0, "null pointer or empty");
  if (in_stride == 0) in_stride = 2 * inter;
  MOE_CUDA_REQUIRE(in_stride >= 2 * inter, "in_stride must be at least 2 * inter");
  MOE_CUDA_TRY(detail::launch_pdl(silu_mul_fused_kernel, dim3(blocks_for(int64_t(rows) * inter)), dim3(256), 0, stream, gate_up, out, rows, inter,
                                                                                in_stride));
  MOE_CUDA_LAUNCHED();
  return {};
}

Status gated_add(float* x, const float* y, const float* gate_logits, int gate_stride, int rows, int n,
                 cudaStream_t stream) {
  MOE_CUDA_REQUIRE(x && y && gate_logits && rows > 0 && n > 0, "null pointer or empty");
  MOE_CUDA_TRY(detail::launch_pdl(gated_add_kernel, dim3(blocks_for(int64_t(rows) * n)), dim3(256), 0, stream, x, y, gate_logits, gate_stride, rows, n));
  MOE_CUDA_LAUNCHED();
  return {};
}

Status add_inplace(float* x, const float* y, int64_t n, cudaStream_t stream) {
  MOE_CUDA_REQUIRE(x && y && n > 0, "null pointer or empty");
  MOE_CUDA_TRY(detail::launch_pdl(add_kernel, dim3(blocks_for(n)), dim3(256), 0, stream, x, y, n));
  MOE_CUDA_LAUNCHED();
  return {};
}

}  // namespace moe::cuda
