// Layer-ahead staging of streamed experts (expert_stage.cuh).
#include <algorithm>

#include "kernels/cuda/cuda_check.cuh"
#include "kernels/cuda/expert_stage.cuh"
#include "kernels/cuda/launch.cuh"

namespace moe::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kUnroll = 4;  // 16-byte loads a thread keeps in flight

__device__ __forceinline__ void put_back(const StageArgs& a, int s) {
  const int2 k = a.staged[s];
  if (k.x < 0) return;
  const size_t at = size_t(k.x) * a.n_experts + k.y;
  a.table[at] = a.host_blobs[at];
  a.staged[s] = make_int2(-1, -1);
}

// The compute stream has started `layer`'s MoE part: its experts run within
// microseconds, before another expert's copy (~60 us for 2.65 MB) could land.
__device__ __forceinline__ bool passed(const StageArgs& a) {
  return a.reached && *reinterpret_cast<const volatile int32_t*>(a.reached) >= a.layer;
}

__global__ void __launch_bounds__(kThreads) stage_kernel(StageArgs a) {
  const int half = (a.layer & 1) * a.top_k;
  // The entries this half held belong to layer - 2, whose kernels are done.
  // Put back before any copy below lands (a landing needs this block too).
  if (blockIdx.x == 0 && int(threadIdx.x) < a.top_k) put_back(a, half + int(threadIdx.x));
  __shared__ int guesses[kThreads];  // read once: the compute stream guesses the layer after meanwhile
  __shared__ bool late;
  for (int j = int(threadIdx.x); j < a.top_k; j += kThreads) guesses[j] = a.guess_ids[j];
  __syncthreads();
  const size_t row = size_t(a.layer) * a.n_experts;
  const size_t words = a.blob_bytes / 16;
  for (int j = 0; j < a.top_k; ++j) {
    const int e = guesses[j];
    bool take = e >= 0 && e < a.n_experts && !a.on_gpu[row + e];
    for (int i = 0; i < j && take; ++i) take = guesses[i] != e;  // a repeated guess is copied once
    if (!take) continue;  // the same in every block
    // A block that finds the compute stream past the layer copies nothing
    // more; it still arrives, marking the slot short, so that the last block
    // to arrive swaps the entry only when every part was copied.
    if (threadIdx.x == 0) late = passed(a);
    __syncthreads();
    const int s = half + j;
    if (!late) {
      const uint4* src = reinterpret_cast<const uint4*>(a.host_blobs[row + e]);
      uint4* dst = reinterpret_cast<uint4*>(a.slots + size_t(s) * a.slot_bytes);
      const size_t stride = size_t(gridDim.x) * kThreads;
      for (size_t w0 = size_t(blockIdx.x) * kThreads + threadIdx.x; w0 < words; w0 += stride * kUnroll) {
        uint4 v[kUnroll];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u)
          if (w0 + u * stride < words) v[u] = src[w0 + u * stride];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u)
          if (w0 + u * stride < words) __stcg(dst + w0 + u * stride, v[u]);
      }
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      __threadfence();  // this block's part of the slot, before its arrival
      // Low 16 bits: blocks arrived; high: blocks that copied nothing.
      const uint32_t add = late ? 0x10001u : 1u;
      const uint32_t now = atomicAdd(a.arrived + s, add) + add;
      if ((now & 0xffffu) == gridDim.x) {
        a.arrived[s] = 0;  // the last block: the slot is free for the next copy
        if ((now >> 16) == 0) {
          __threadfence();  // every part landed (each fenced before it arrived)
          a.table[row + e] = a.slots + size_t(s) * a.slot_bytes;
          a.staged[s] = make_int2(a.layer, e);
          atomicAdd(a.landed, 1u);
        }
      }
    }
  }
}

__global__ void restore_kernel(StageArgs a) {
  for (int s = int(threadIdx.x); s < 2 * a.top_k; s += blockDim.x) put_back(a, s);
}

__global__ void copy_f32_kernel(const float* src, float* dst, size_t n, int32_t* mark, int32_t mark_value) {
  detail::allow_next_grid();
  detail::wait_prior_grid();
  for (size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
    dst[i] = src[i];
  if (mark && blockIdx.x == 0 && threadIdx.x == 0) *reinterpret_cast<volatile int32_t*>(mark) = mark_value;
}

Status check(const StageArgs& a) {
  MOE_CUDA_REQUIRE(a.table && a.on_gpu && a.host_blobs && a.slots && a.staged && a.arrived && a.landed,
                   "null pointer");
  MOE_CUDA_REQUIRE(a.top_k > 0 && a.top_k <= kThreads && a.n_experts > 0, "top_k in [1, 256], n_experts positive");
  MOE_CUDA_REQUIRE(a.blob_bytes % 16 == 0 && a.slot_bytes >= a.blob_bytes && a.slot_bytes % 256 == 0,
                   "blob bytes a multiple of 16, slots of 256 holding one");
  return {};
}

}  // namespace

Status stage_experts(const StageArgs& a, cudaStream_t stream) {
  if (Status s = check(a); !s.ok()) return s;
  MOE_CUDA_REQUIRE(a.guess_ids && a.layer >= 0, "guesses and their layer");
  stage_kernel<<<kStageBlocks, kThreads, 0, stream>>>(a);
  MOE_CUDA_LAUNCHED();
  return {};
}

Status restore_staged(const StageArgs& a, cudaStream_t stream) {
  if (Status s = check(a); !s.ok()) return s;
  restore_kernel<<<1, 64, 0, stream>>>(a);
  MOE_CUDA_LAUNCHED();
  return {};
}

Status copy_f32(const float* src, float* dst, size_t n, cudaStream_t stream, int32_t* mark, int32_t mark_value) {
  MOE_CUDA_REQUIRE(src && dst, "null pointer");
  if (n == 0 && !mark) return {};
  const int blocks = int(std::max<size_t>(1, std::min<size_t>((n + 255) / 256, 64)));
  MOE_CUDA_TRY(
      detail::launch_pdl(copy_f32_kernel, dim3(blocks), dim3(256), 0, stream, src, dst, n, mark, mark_value));
  MOE_CUDA_LAUNCHED();
  return {};
}

}  // namespace moe::cuda
