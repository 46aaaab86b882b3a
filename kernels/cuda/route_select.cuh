#pragma once
// How one token's experts are chosen on the device, shared by the router
// kernels (router.cu) and the fused decode pass (fused_decode.cu), so that
// both pick the same experts with the same weights: the router's softmax and
// top-k, and the benchmarks' forced routing (router.cuh, ForcedRouting).

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/device_math.cuh"

namespace moe::cuda::detail {

__host__ __device__ __forceinline__ uint64_t mix64(uint64_t z) {
  z += 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// Token t's k distinct experts drawn from a hash of (seed, layer, position,
// sequence); a drawn expert already taken moves to the next free index
// (k <= n, so one is always free).
__device__ inline void draw_uniform(int32_t* row, int n, int k, int32_t position, int32_t seq, int layer,
                                    uint64_t seed) {
  uint64_t h = mix64(seed ^ mix64(uint64_t(layer) << 40 ^ uint64_t(uint32_t(position)) << 8 ^ uint64_t(uint32_t(seq))));
  for (int j = 0; j < k; ++j) {
    h = mix64(h);
    int e = int(h % uint64_t(n));
    for (bool taken = true; taken;) {
      taken = false;
      for (int i = 0; i < j; ++i)
        if (row[i] == e) taken = true;
      if (taken) e = (e + 1) % n;
    }
    row[j] = e;
  }
}

// The row of a recorded trace that the token at `position` of sequence `seq`
// replays (router.cuh, force_experts).
__host__ __device__ inline int replay_row_of(int32_t seq, int32_t position, int trace_tokens) {
  const uint64_t offset = mix64(0x7e91ace5ull ^ uint64_t(uint32_t(seq))) % uint64_t(trace_tokens);
  return int((offset + uint64_t(uint32_t(position))) % uint64_t(trace_tokens));
}

// One warp: softmax over the n logits of `row`, then the k best (best first,
// equal probabilities keep the lower index first) into ids and weights,
// renormalised to sum to 1 when asked, times scale. p: n floats of scratch
// (shared memory); ids and weights may be global or shared. The warp's
// lanes see every id and weight written when it returns.
__device__ inline void select_top_k_warp(const float* row, int n, int k, bool renorm, float scale, float* p,
                                         int32_t* ids, float* weights) {
  const int lane = threadIdx.x & 31;
  float mx = -INFINITY;
  for (int i = lane; i < n; i += 32) mx = fmaxf(mx, row[i]);
  mx = warp_max(mx);
  float sum = 0.f;
  for (int i = lane; i < n; i += 32) {
    p[i] = __expf(row[i] - mx);
    sum += p[i];
  }
  const float inv = 1.f / warp_sum(sum);
  __syncwarp();
  float picked = 0.f;
  for (int j = 0; j < k; ++j) {
    float best = -1.f;
    int bi = n;
    for (int i = lane; i < n; i += 32)
      if (p[i] > best) {  // ascending i: the lowest index wins ties within a lane
        best = p[i];
        bi = i;
      }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      const float ob = __shfl_xor_sync(0xffffffffu, best, o);
      const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
      if (ob > best || (ob == best && oi < bi)) {
        best = ob;
        bi = oi;
      }
    }
    if (lane == 0) {
      ids[j] = bi;
      weights[j] = best * inv;
      p[bi] = -2.f;  // taken
    }
    picked += best * inv;
    __syncwarp();
  }
  for (int j = lane; j < k; j += 32) {
    float w = weights[j];
    if (renorm) w /= picked;
    weights[j] = w * scale;
  }
  __syncwarp();
}

}  // namespace moe::cuda::detail
