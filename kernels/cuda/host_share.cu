#include "kernels/cuda/host_share.cuh"

#include "kernels/cuda/cuda_check.cuh"

namespace moe::cuda {

namespace {

__device__ __forceinline__ uint64_t global_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__global__ void share_publish_kernel(SharePublishArgs a) { share_publish_warp(a, int(threadIdx.x)); }

__global__ void share_collect_kernel(ShareSlot* slot, const float* sum_host, float* x, int n,
                                     const uint32_t* pass, const uint32_t* host_count, uint64_t timeout_ns) {
  if (*host_count == 0) return;
  __shared__ int ok;
  if (threadIdx.x == 0) {
    const uint32_t want = *pass;
    const uint64_t t0 = global_ns();
    uint64_t t = t0;
    ok = 1;
    // ld.cv: fetched anew each time, never a cached copy of host memory.
    while (__ldcv(&slot->done) != want) {
      __nanosleep(256);
      t = global_ns();
      if (t - t0 > timeout_ns) {
        ok = 0;
        break;
      }
    }
    if (blockIdx.x == 0) *reinterpret_cast<volatile uint64_t*>(&slot->waited_ns) = t - t0;
  }
  __syncthreads();
  if (!ok) __trap();
  // One element a thread: the reads over the link are all in flight at once.
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) x[i] += __ldcv(sum_host + i);
}

}  // namespace

Status share_publish(const SharePublishArgs& a, cudaStream_t stream) {
  MOE_CUDA_REQUIRE(a.tokens >= 1 && a.tokens <= kShareMaxTokens && a.top_k >= 1 && a.top_k <= kShareMaxTopK &&
                       a.slot && a.hidden > 0,
                   "share_publish: 1-8 tokens, top_k 1-16, a slot");
  share_publish_kernel<<<1, 32, 0, stream>>>(a);
  MOE_CUDA_TRY(cudaGetLastError());
  return {};
}

Status share_collect(ShareSlot* slot, const float* sum_host, float* x, int tokens, int hidden, const uint32_t* pass,
                     const uint32_t* host_count, int timeout_ms, cudaStream_t stream) {
  // Every block waits for the flag itself and adds its slice of the sums.
  const int n = tokens * hidden;
  share_collect_kernel<<<(n + 255) / 256, 256, 0, stream>>>(slot, sum_host, x, n, pass, host_count,
                                                           uint64_t(timeout_ms) * 1000000ull);
  MOE_CUDA_TRY(cudaGetLastError());
  return {};
}

}  // namespace moe::cuda
