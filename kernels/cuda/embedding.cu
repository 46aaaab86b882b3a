#include "kernels/cuda/cuda_check.cuh"
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/embedding.cuh"

namespace moe::cuda {
namespace {

__global__ void gather_kernel(const __nv_bfloat16* table, int vocab, int hidden, const int32_t* tokens, float* x) {
  detail::allow_next_grid();
  detail::wait_prior_grid();
  const int t = blockIdx.x, id = tokens[t];
  const bool ok = id >= 0 && id < vocab;
  for (int i = threadIdx.x; i < hidden; i += blockDim.x)
    x[size_t(t) * hidden + i] = ok ? __bfloat162float(table[size_t(id) * hidden + i]) : 0.f;
}

__global__ void gather_rows_kernel(const float* src, const int32_t* rows, int dim, float* dst) {
  detail::allow_next_grid();
  detail::wait_prior_grid();
  const int r = blockIdx.x;
  const float* s = src + size_t(rows[r]) * dim;
  for (int i = threadIdx.x; i < dim; i += blockDim.x) dst[size_t(r) * dim + i] = s[i];
}

}  // namespace

Status gather_rows_f32(const float* src, const int32_t* rows, int n_rows, int dim, float* dst,
                       cudaStream_t stream) {
  MOE_CUDA_REQUIRE(src && rows && dst && n_rows > 0 && dim > 0, "null pointer or empty");
  MOE_CUDA_TRY(detail::launch_pdl(gather_rows_kernel, dim3(n_rows), dim3(256), 0, stream, src, rows, dim, dst));
  MOE_CUDA_LAUNCHED();
  return {};
}

Status embedding_gather(const __nv_bfloat16* table, int vocab, int hidden, const int32_t* tokens, int n_tokens,
                        float* x, cudaStream_t stream) {
  MOE_CUDA_REQUIRE(table && tokens && x && vocab > 0 && hidden > 0 && n_tokens > 0, "null pointer or empty");
  MOE_CUDA_TRY(detail::launch_pdl(gather_kernel, dim3(n_tokens), dim3(256), 0, stream, table, vocab, hidden, tokens, x));
  MOE_CUDA_LAUNCHED();
  return {};
}

}  // namespace moe::cuda
