#include "kernels/cuda/activation.cuh"
#include "kernels/cuda/cuda_check.cuh"
#include "kernels/cuda/device_math.cuh"

namespace moe::cuda {
namespace {

__global__ void silu_mul_kernel(const float* g, const float* u, float* o, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    o[i] = detail::silu(g[i]) * u[i];
}

__global__ void silu_mul_fused_kernel(const float* gu, __nv_bfloat16* o, int rows, int inter) {
  const int64_t n = int64_t(rows) * inter;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = i / inter, c = i % inter;
    const float* row = gu + r * 2 * inter;
    o[i] = __float2bfloat16(detail::silu(row[c]) * row[inter + c]);
  }
}

int blocks_for(int64_t n) { return int(std::min<int64_t>((n + 255) / 256, 4096)); }

}  // namespace

Status silu_mul(const float* gate, const float* up, float* out, int64_t n, cudaStream_t stream) {
  MOE_CUDA_REQUIRE(gate && up && out && n > 0, "null pointer or empty");
  silu_mul_kernel<<<blocks_for(n), 256, 0, stream>>>(gate, up, out, n);
  MOE_CUDA_LAUNCHED();
  return {};
}

Status silu_mul_fused(const float* gate_up, __nv_bfloat16* out, int rows, int inter, cudaStream_t stream) {
  MOE_CUDA_REQUIRE(gate_up && out && rows > 0 && inter > 0, "null pointer or empty");
  silu_mul_fused_kernel<<<blocks_for(int64_t(rows) * inter), 256, 0, stream>>>(gate_up, out, rows, inter);
  MOE_CUDA_LAUNCHED();
  return {};
}

}  // namespace moe::cuda
