#include <cuda_fp16.h>

#include "bench/gpu/random_weights.cuh"
#include "kernels/cuda/cuda_check.cuh"
#include "kernels/cuda/launch.cuh"

namespace moe::bench {
namespace {

__device__ __forceinline__ uint64_t mix(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

__device__ __forceinline__ float unit(uint64_t h) { return float(h >> 40) * (1.f / 16777216.f); }  // [0, 1)

__global__ void fill_bf16_kernel(__nv_bfloat16* p, size_t n, uint64_t seed, float scale, float offset) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
    p[i] = __float2bfloat16(offset + scale * (2.f * unit(mix(seed ^ (i * 0xD6E8FEB86659FD93ull))) - 1.f));
}

__global__ void fill_bytes_kernel(uint32_t* p, size_t n_words, uint64_t seed) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n_words; i += size_t(gridDim.x) * blockDim.x)
    p[i] = uint32_t(mix(seed ^ (i * 0xD6E8FEB86659FD93ull)));
}

__global__ void fill_params_kernel(uint8_t* blobs, size_t blob_bytes, int n_blobs, size_t offset, size_t count,
                                   uint64_t seed, float scale) {
  const size_t total = count * n_blobs;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < total; i += size_t(gridDim.x) * blockDim.x) {
    const size_t b = i / count, j = i % count;
    const float s = scale * (0.5f + unit(mix(seed ^ (i * 0x9E3779B97F4A7C15ull))));
    reinterpret_cast<half2*>(blobs + b * blob_bytes + offset)[j] = __floats2half2_rn(s, -7.5f * s);
  }
}

constexpr int kGrid = 4096, kBlock = 256;

}  // namespace

Status fill_bf16(__nv_bfloat16* p, size_t n, uint64_t seed, float scale, float offset, cudaStream_t stream) {
  fill_bf16_kernel<<<kGrid, kBlock, 0, stream>>>(p, n, seed, scale, offset);
  MOE_CUDA_LAUNCHED();
  return {};
}

Status fill_experts(uint8_t* blobs, const ExpertLayout& L, int n_blobs, uint64_t seed, float scale_in,
                    float scale_down, cudaStream_t stream) {
  MOE_CUDA_REQUIRE(L.blob_bytes % 4 == 0, "blob size must be a multiple of 4");
  fill_bytes_kernel<<<kGrid, kBlock, 0, stream>>>(reinterpret_cast<uint32_t*>(blobs),
                                                  L.blob_bytes * n_blobs / 4, seed);
  MOE_CUDA_LAUNCHED();
  const Q4MatrixLayout* ms[3] = {&L.gate, &L.up, &L.down};
  for (int i = 0; i < 3; ++i) {
    const size_t count = size_t(ms[i]->rows) * (ms[i]->cols / ms[i]->group);
    fill_params_kernel<<<kGrid, kBlock, 0, stream>>>(blobs, L.blob_bytes, n_blobs, ms[i]->params_offset, count,
                                                     seed + 1 + i, i == 2 ? scale_down : scale_in);
    MOE_CUDA_LAUNCHED();
  }
  return {};
}

__global__ void advance_kernel(int32_t* p, int n) {
  cuda::detail::allow_next_grid();
  cuda::detail::wait_prior_grid();
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) p[i] += 1;
}

Status advance_positions(int32_t* positions, int n, cudaStream_t stream) {
  MOE_CUDA_TRY(cuda::detail::launch_pdl(advance_kernel, dim3((n + 255) / 256), dim3(256), 0, stream, positions, n));
  MOE_CUDA_LAUNCHED();
  return {};
}

}  // namespace moe::bench
