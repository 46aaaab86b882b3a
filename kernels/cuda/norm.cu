#include "kernels/cuda/cuda_check.cuh"
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/device_math.cuh"
#include "kernels/cuda/norm.cuh"

namespace moe::cuda {
namespace {

constexpr int kThreads = 256;

template <typename YT>
__global__ void __launch_bounds__(kThreads)
    rmsnorm_kernel(float* x, const float* add, const __nv_bfloat16* w, YT* y, int dim, float eps) {
  detail::allow_next_grid();
  detail::wait_prior_grid();
  __shared__ float scratch[kThreads / 32];
  float* xr = x + size_t(blockIdx.x) * dim;
  const float* ar = add ? add + size_t(blockIdx.x) * dim : nullptr;
  float ss = 0.f;
  for (int i = threadIdx.x; i < dim; i += blockDim.x) {
    float v = xr[i];
    if (ar) {
      v += ar[i];
      xr[i] = v;  // the residual stream keeps the sum
    }
    ss += v * v;
  }
  ss = detail::block_sum(ss, scratch);
  const float inv = rsqrtf(ss / float(dim) + eps);
  YT* yr = y + size_t(blockIdx.x) * dim;
  for (int i = threadIdx.x; i < dim; i += blockDim.x)
    yr[i] = detail::from_f<YT>(__bfloat162float(w[i]) * (xr[i] * inv));
}

template <typename YT>
Status launch(float* x, const float* add, const __nv_bfloat16* w, YT* y, int rows, int dim, float eps,
              cudaStream_t stream) {
  MOE_CUDA_REQUIRE(x && w && y, "null pointer");
  MOE_CUDA_REQUIRE(rows > 0 && dim > 0, "rows and dim must be positive");
  MOE_CUDA_TRY(detail::launch_pdl(rmsnorm_kernel<YT>, dim3(rows), dim3(kThreads), 0, stream, x, add, w, y, dim, eps));
  MOE_CUDA_LAUNCHED();
  return {};
}

}  // namespace

Status rmsnorm(const float* x, const __nv_bfloat16* w, __nv_bfloat16* y, int rows, int dim, float eps,
               cudaStream_t stream) {
  return launch(const_cast<float*>(x), nullptr, w, y, rows, dim, eps, stream);
}
Status rmsnorm(const float* x, const __nv_bfloat16* w, float* y, int rows, int dim, float eps,
               cudaStream_t stream) {
  return launch(const_cast<float*>(x), nullptr, w, y, rows, dim, eps, stream);
}
Status add_rmsnorm(float* residual, const float* add, const __nv_bfloat16* w, __nv_bfloat16* y, int rows,
                   int dim, float eps, cudaStream_t stream) {
  return launch(residual, add, w, y, rows, dim, eps, stream);
}

}  // namespace moe::cuda
