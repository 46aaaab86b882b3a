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

}  // namespace

Status embedding_gather(const __nv_bfloat16* table, int vocab, int hidden, const int32_t* tokens, int n_tokens,
                        float* x, cudaStream_t stream) {
  MOE_CUDA_REQUIRE(table && tokens && x && vocab > 0 && hidden > 0 && n_tokens > 0, "null pointer or empty");
  MOE_CUDA_TRY(detail::launch_pdl(gather_kernel, dim3(n_tokens), dim3(256), 0, stream, table, vocab, hidden, tokens, x));
  MOE_CUDA_LAUNCHED();
  return {};
}

}  // namespace moe::cuda
