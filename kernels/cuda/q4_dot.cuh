#pragma once
// The INT4 decode dot products' fast path, shared by the decode GEMVs
// (q4_gemv.cu) and the fused decode pass (fused_decode.cu): activations
// staged once in shared memory as half2 scaled per 32-input chunk, a row's
// 16-byte runs of codes dotted with them in half2, scale and bias applied in
// f32:
//   sum_i (q_i s + b) x_i = s * m_c * sum_i q_i (x_i / m_c) + b * sum_i x_i.
// Needs K a multiple of 32, groups of 32 inputs or more, K <= 32 * 32 * CPL.

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstring>
#include <type_traits>

#include "kernels/cuda/device_math.cuh"
#include "model/int4.h"

namespace moe::cuda::detail {

constexpr int kMaxFastChunks = 128;  // 4 chunks per lane: K <= 4096

// True where a matrix's layout takes the fast path: whole 32-input chunks,
// groups of whole chunks, K <= 4096, codes in 16-byte runs, params in words.
__host__ __device__ inline bool q4_fast_layout(const Q4MatrixLayout& m) {
  return m.cols % 32 == 0 && m.group % 32 == 0 && m.cols / 32 <= kMaxFastChunks && m.codes_offset % 16 == 0 &&
         m.params_offset % 4 == 0;
}

// Bytes of shared memory one staged vector of K inputs takes.
// Per staged vector; a multiple of 16 bytes so that the next vector's
// 16-byte runs stay aligned (an odd chunk count would leave 8 over).
__host__ __device__ inline size_t staged_bytes(int K, bool fast) {
  return fast ? (size_t(K / 32) * (64 + 8) + 15) / 16 * 16 : size_t(K) * 4;
}

// Fast staging: chunk c (32 inputs), word q (inputs 8q..8q+7 of the chunk):
// xs[q * nchunks + c] = 4 half2 (x0,x4) (x1,x5) (x2,x6) (x3,x7) of x / m_c,
// matching the nibble order one 32-bit code word unpacks into (see dot).
// stats[c] = (m_c = max |x| over the chunk, sum of x over the chunk).
__device__ __forceinline__ void load4(const float* p, float v[4]) {
  const float4 f = *reinterpret_cast<const float4*>(p);
  v[0] = f.x, v[1] = f.y, v[2] = f.z, v[3] = f.w;
}
__device__ __forceinline__ void load4(const __nv_bfloat16* p, float v[4]) {
  const uint2 u = *reinterpret_cast<const uint2*>(p);
  __nv_bfloat162 a, b;
  memcpy(&a, &u.x, 4);
  memcpy(&b, &u.y, 4);
  const float2 fa = __bfloat1622float2(a), fb = __bfloat1622float2(b);
  v[0] = fa.x, v[1] = fa.y, v[2] = fb.x, v[3] = fb.y;
}

// Eight threads stage one chunk, four inputs each; the chunk's max and sum
// come from shuffles within the eight. `nvec` vectors of nchunks chunks lie
// one after another in x (a token's top_k down inputs, or one vector);
// vector k is staged at base + k * per. The loads of up to kStageBatch rounds
// are issued before any is used, so staging costs one memory latency, not
// one per round (BATCH: the rounds the caller expects, which sets the
// registers it costs). Every lane of a warp runs the same number of rounds
// (shuffles need the whole warp).
// Vector k's K inputs start at src(k), or at x + k * K where src is nullptr
// (no division a staged item then: it costs batch 8 ~3 %).
template <int kStageBatch, typename XT, typename Src>
__device__ void stage_fast_from(const XT* __restrict__ x, Src src, int nchunks, int nvec, uint8_t* base,
                                size_t per) {
  const int items = nvec * nchunks * 8;
  const int rounds = (items + blockDim.x - 1) / blockDim.x;
  for (int r0 = 0; r0 < rounds; r0 += kStageBatch) {
    float v[kStageBatch][4];
#pragma unroll
    for (int j = 0; j < kStageBatch; ++j) {
      const int i = (r0 + j) * blockDim.x + threadIdx.x;
      v[j][0] = v[j][1] = v[j][2] = v[j][3] = 0.f;
      if (r0 + j < rounds && i < items) {
        if constexpr (std::is_same_v<Src, std::nullptr_t>) {
          load4(x + size_t(i >> 3) * 32 + (i & 7) * 4, v[j]);  // the vectors one after another
        } else {
          const int g = i >> 3, k = g / nchunks;
          load4(src(k) + size_t(g - k * nchunks) * 32 + (i & 7) * 4, v[j]);
        }
      }
    }
#pragma unroll
    for (int j = 0; j < kStageBatch; ++j) {
      if (r0 + j >= rounds) break;  // uniform across the block
      const int i = (r0 + j) * blockDim.x + threadIdx.x;
      const bool on = i < items;
      const int g = i >> 3, sub = i & 7;
      float m = fmaxf(fmaxf(fabsf(v[j][0]), fabsf(v[j][1])), fmaxf(fabsf(v[j][2]), fabsf(v[j][3])));
      float sm = (v[j][0] + v[j][1]) + (v[j][2] + v[j][3]);
#pragma unroll
      for (int o = 1; o < 8; o <<= 1) {
        m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
        sm += __shfl_xor_sync(0xffffffffu, sm, o);
      }
      const float inv = m > 1e-30f ? 1.f / m : 0.f;  // a chunk this small adds nothing; 1 / m would overflow
      // Word q = subs 2q (inputs 0..3) and 2q+1 (inputs 4..7): swap with the
      // partner, then the even sub writes (x0,x4) (x1,x5), the odd (x2,x6) (x3,x7).
      float w[4];
#pragma unroll
      for (int q = 0; q < 4; ++q) w[q] = __shfl_xor_sync(0xffffffffu, v[j][q], 1);
      if (on) {
        const int k = g / nchunks, c = g - k * nchunks;
        uint8_t* vb = base + size_t(k) * per;
        uint4* xs = reinterpret_cast<uint4*>(vb);
        const bool odd = sub & 1;
        // even: (v0, w0) (v1, w1); odd: (w2, v2) (w3, v3)
        const float l0 = odd ? w[2] : v[j][0], h0 = odd ? v[j][2] : w[0];
        const float l1 = odd ? w[3] : v[j][1], h1 = odd ? v[j][3] : w[1];
        uint2 u;
        u.x = half2_bits(__floats2half2_rn(l0 * inv, h0 * inv));
        u.y = half2_bits(__floats2half2_rn(l1 * inv, h1 * inv));
        reinterpret_cast<uint2*>(xs + (sub >> 1) * nchunks + c)[odd] = u;
        if (sub == 0) reinterpret_cast<float2*>(vb + size_t(nchunks) * 64)[c] = make_float2(m, sm);
      }
    }
  }
}

// nvec vectors one after another in x.
template <int kStageBatch, typename XT>
__device__ void stage_fast(const XT* __restrict__ x, int nchunks, int nvec, uint8_t* base, size_t per) {
  stage_fast_from<kStageBatch, XT>(x, nullptr, nchunks, nvec, base, per);
}

// sum over one 32-input chunk of q_i * (x_i / m_c), in half2.
__device__ __forceinline__ float chunk_dot(const uint4 w, const uint4* xs, int nchunks, int c) {
  const uint32_t ws[4] = {w.x, w.y, w.z, w.w};
  const half2 k1024 = __float2half2_rn(1024.f);
  half2 d0 = __float2half2_rn(0.f), d1 = d0;
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    const uint4 xv = xs[q * nchunks + c];
    const uint32_t wq = ws[q];
    // 0x6400 | n is the half 1024 + n: OR in the exponent, subtract 1024.
    const half2 a0 = __hsub2(as_half2((wq & 0x000F000Fu) | 0x64006400u), k1024);
    const half2 a1 = __hsub2(as_half2(((wq >> 4) & 0x000F000Fu) | 0x64006400u), k1024);
    const half2 a2 = __hsub2(as_half2(((wq >> 8) & 0x000F000Fu) | 0x64006400u), k1024);
    const half2 a3 = __hsub2(as_half2(((wq >> 12) & 0x000F000Fu) | 0x64006400u), k1024);
    d0 = __hfma2(a0, as_half2(xv.x), d0);
    d1 = __hfma2(a1, as_half2(xv.y), d1);
    d0 = __hfma2(a2, as_half2(xv.z), d0);
    d1 = __hfma2(a3, as_half2(xv.w), d1);
  }
  const float2 f0 = __half22float2(d0), f1 = __half22float2(d1);
  return (f0.x + f0.y) + (f1.x + f1.y);
}

// One row's codes and (scale, bias) words for this lane, loaded before use so
// that several rows' loads are in flight together.
template <int CPL>
struct FastRow {
  uint4 w[CPL];
  half2 sb[CPL];

  __device__ __forceinline__ void load(const uint8_t* blob, const Q4MatrixLayout& m, int row,
                                       int nchunks, int group_shift, int lane) {
    const uint4* codes =
        reinterpret_cast<const uint4*>(blob + m.codes_offset + size_t(row) * (m.cols / 2));
    const half2* params = reinterpret_cast<const half2*>(blob + m.params_offset) +
                          size_t(row) * (m.cols / m.group);
#pragma unroll
    for (int i = 0; i < CPL; ++i) {
      const int c = lane + 32 * i;
      if (c < nchunks) {
        w[i] = __ldg(codes + c);
        sb[i] = params[c >> group_shift];
      }
    }
  }

  // Tells the compiler the codes may have changed, so that a loop dotting
  // them with several inputs unpacks them anew each time rather than holding
  // every unpacked half (4x the registers) across the loop.
  __device__ __forceinline__ void opaque() {
#pragma unroll
    for (int i = 0; i < CPL; ++i) asm volatile("" : "+r"(w[i].x), "+r"(w[i].y), "+r"(w[i].z), "+r"(w[i].w));
  }

  __device__ __forceinline__ float dot(const uint4* xs, const float2* stats, int nchunks,
                                       int lane) const {
    float acc = 0.f;
#pragma unroll
    for (int i = 0; i < CPL; ++i) {
      const int c = lane + 32 * i;
      if (c < nchunks) {
        const float d = chunk_dot(w[i], xs, nchunks, c);
        const float2 st = stats[c];
        const float2 f = __half22float2(sb[i]);
        acc = fmaf(f.x * st.x, d, acc);
        acc = fmaf(f.y, st.y, acc);
      }
    }
    return acc;
  }
};


}  // namespace moe::cuda::detail
