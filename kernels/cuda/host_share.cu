#include "kernels/cuda/host_share.cuh"

#include "kernels/cuda/cuda_check.cuh"

namespace moe::cuda {

namespace {

__device__ __forceinline__ uint64_t global_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__global__ void share_publish_kernel(SharePublishArgs a) {
  __shared__ int take;
  if (threadIdx.x == 0) {
    int m = 0;
    for (int k = 0; k < a.top_k; ++k) {
      const int e = a.ids[k];
      m += e >= 0 && e < a.n_experts && !a.on_gpu[e];
    }
    const int rows = a.rows[m];
    take = rows > 0 ? m : 0;
    int i = 0;
    for (int k = 0; k < a.top_k; ++k) {
      const int e = a.ids[k];
      const bool shared = take > 0 && e >= 0 && e < a.n_experts && !a.on_gpu[e];
      a.gpu_ids[k] = shared && rows >= a.inter ? -1 : e;  // a whole expert on the host: skipped here
      a.gpu_split[k] = shared ? rows : 0;
      if (shared) {
        a.slot->expert[i] = e;
        a.slot->weight[i] = a.route_w[k];
        ++i;
      }
    }
    a.slot->count = uint32_t(take);
    a.slot->rows = uint32_t(rows);
    *a.host_count = uint32_t(take);
  }
  __syncthreads();
  if (take > 0)
    for (int i = threadIdx.x; i < a.hidden; i += blockDim.x) a.x_host[i] = a.xn[i];
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence_system();  // the pairs and the state reach the host before the flag
    *reinterpret_cast<volatile uint32_t*>(&a.slot->posted) = *a.pass;
  }
}

__global__ void share_collect_kernel(const ShareSlot* slot, const float* sum_host, float* x, int hidden,
                                     const uint32_t* pass, const uint32_t* host_count, uint64_t timeout_ns) {
  if (*host_count == 0) return;
  __shared__ int ok;
  if (threadIdx.x == 0) {
    const uint32_t want = *pass;
    const uint64_t t0 = global_ns();
    ok = 1;
    // ld.cv: fetched anew each time, never a cached copy of host memory.
    while (__ldcv(&slot->done) != want) {
      __nanosleep(256);
      if (global_ns() - t0 > timeout_ns) {
        ok = 0;
        break;
      }
    }
  }
  __syncthreads();
  if (!ok) __trap();
  // One element a thread: the reads over the link are all in flight at once.
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < hidden) x[i] += __ldcv(sum_host + i);
}

}  // namespace

Status share_publish(const SharePublishArgs& a, cudaStream_t stream) {
  if (a.top_k < 1 || a.top_k > kShareMaxPairs || a.hidden < 1)
    return make_error("share_publish: top_k must be in [1, 16] and hidden positive");
  share_publish_kernel<<<1, 256, 0, stream>>>(a);
  MOE_CUDA_TRY(cudaGetLastError());
  return {};
}

Status share_collect(const ShareSlot* slot, const float* sum_host, float* x, int hidden, const uint32_t* pass,
                     const uint32_t* host_count, int timeout_ms, cudaStream_t stream) {
  // Every block waits for the flag itself and adds its slice of the sum.
  share_collect_kernel<<<(hidden + 255) / 256, 256, 0, stream>>>(slot, sum_host, x, hidden, pass, host_count,
                                                                uint64_t(timeout_ms) * 1000000ull);
  MOE_CUDA_TRY(cudaGetLastError());
  return {};
}

}  // namespace moe::cuda
