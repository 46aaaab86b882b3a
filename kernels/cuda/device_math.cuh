#pragma once
// Small device helpers shared by the kernels' .cu files (not a public API).

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>

namespace moe::cuda::detail {

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Sum over the whole block; `scratch` holds one float per warp. All threads
// get the result.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
  v = warp_sum(v);
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  float t = 0.f;
  for (int i = 0; i < nw; ++i) t += scratch[i];
  return t;
}

__device__ __forceinline__ float to_f(float v) { return v; }
__device__ __forceinline__ float to_f(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T>
__device__ __forceinline__ T from_f(float v);
template <>
__device__ __forceinline__ float from_f<float>(float v) { return v; }
template <>
__device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float v) { return __float2bfloat16(v); }

// A 32-bit word as two halves and back (INT4 codes become halves by bits).
__device__ __forceinline__ half2 as_half2(uint32_t u) {
  half2 h;
  memcpy(&h, &u, 4);
  return h;
}
__device__ __forceinline__ uint32_t half2_bits(half2 h) {
  uint32_t u;
  memcpy(&u, &h, 4);
  return u;
}

// D consecutive bf16 values (D = 2, 4 or 8) as one 4-, 8- or 16-byte load.
template <int D>
__device__ __forceinline__ void load_row_part(const __nv_bfloat16* p, float* out) {
  uint32_t w[D / 2];
  if constexpr (D == 2) {
    w[0] = *reinterpret_cast<const uint32_t*>(p);
  } else if constexpr (D == 4) {
    const uint2 u = *reinterpret_cast<const uint2*>(p);
    w[0] = u.x, w[1] = u.y;
  } else {
    const uint4 u = *reinterpret_cast<const uint4*>(p);
    w[0] = u.x, w[1] = u.y, w[2] = u.z, w[3] = u.w;
  }
#pragma unroll
  for (int i = 0; i < D / 2; ++i) {
    __nv_bfloat162 b;
    memcpy(&b, &w[i], 4);
    const float2 f = __bfloat1622float2(b);
    out[2 * i] = f.x;
    out[2 * i + 1] = f.y;
  }
}

// One 32-bit word of INT4 codes (8 inputs, the even ones in the low nibbles,
// docs/int4-experts.md) as the floats 0..15 in input order. A nibble becomes
// the low byte of 2^23 (0x4B000000) and 2^23 is subtracted: a byte permute
// and an add, where an integer-to-float conversion would run at an eighth of
// the rate.
__device__ __forceinline__ void q4_word_to_floats(uint32_t word, float (&f)[8]) {
  const uint32_t lo = word & 0x0F0F0F0Fu, hi = (word >> 4) & 0x0F0F0F0Fu;
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    f[2 * e] = __uint_as_float(__byte_perm(lo, 0x4B000000u, 0x7440u + e)) - 8388608.f;
    f[2 * e + 1] = __uint_as_float(__byte_perm(hi, 0x4B000000u, 0x7440u + e)) - 8388608.f;
  }
}

// Four signed bytes of `word` as floats, in byte order: each byte biased to
// q + 128 becomes the low mantissa byte of 2^23 (0x4B000000), and 2^23 + 128
// is subtracted, leaving q exactly (a byte permute and an add a value).
__device__ __forceinline__ void i8x4_to_floats(uint32_t word, float* f) {
  const uint32_t biased = word ^ 0x80808080u;
#pragma unroll
  for (int e = 0; e < 4; ++e) f[e] = __uint_as_float(__byte_perm(biased, 0x4B000000u, 0x7440u + e)) - 8388736.f;
}

// Eight bf16 values (16 bytes) as floats.
__device__ __forceinline__ void bf16x8_to_float(const uint4& u, float (&f)[8]) {
  const __nv_bfloat162* b = reinterpret_cast<const __nv_bfloat162*>(&u);
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    const float2 p = __bfloat1622float2(b[e]);
    f[2 * e] = p.x;
    f[2 * e + 1] = p.y;
  }
}

__device__ __forceinline__ float silu(float v) { return v / (1.f + __expf(-v)); }
__device__ __forceinline__ float sigmoid(float v) { return 1.f / (1.f + __expf(-v)); }

// One m16n8k16 tensor-core step, bf16 inputs and f32 accumulators (sm_80+;
// a no-op where the instruction does not exist). Fragment layouts, g = lane
// / 4 and c = lane % 4: a0..a3 hold A's (row g, cols 2c..2c+1), (g + 8,
// 2c), (g, 2c + 8), (g + 8, 2c + 8); b0, b1 hold B's (rows 2c..2c+1, col
// g) and (2c + 8, g); d0..d3 hold D's (g, 2c..2c+1) and (g + 8, 2c..2c+1).
__device__ __forceinline__ void mma_bf16_16816(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                               uint32_t b0, uint32_t b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
#endif
}

// Four 8x8 matrices of 16-bit values from shared memory: lane i gives the
// address of row i % 8 of matrix i / 8 (16 contiguous bytes); r[m] gets
// matrix m's (row lane / 4, cols 2 (lane % 4)..+1), or with trans its
// (rows 2 (lane % 4)..+1, col lane / 4): B fragments of mma_bf16_16816
// from rows of N values (kTrans: rows of K values). sm_75+.
template <bool kTrans = false>
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* row) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 750
  const uint32_t a = uint32_t(__cvta_generic_to_shared(row));
  if constexpr (kTrans)
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a));
  else
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a));
#endif
}

// Two floats as a bf16 pair in one word (a in the low half: the lower index).
__device__ __forceinline__ uint32_t bf16x2_bits(float a, float b) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(a, b);
  uint32_t u;
  memcpy(&u, &v, 4);
  return u;
}

}  // namespace moe::cuda::detail
