#include "kernels/cuda/cuda_check.cuh"
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/dense_matmul.cuh"
#include "kernels/cuda/device_math.cuh"

#include <cuda_fp16.h>

#include <algorithm>
#include <cstring>
#include <type_traits>

namespace moe::cuda {
namespace {

constexpr int kWarps = 8;
constexpr int kRowsPerWarp = 2;
constexpr int kThreads = kWarps * 32;

// x staged in shared memory as bf16 [tokens, k]; each lane takes 16-byte runs
// of weights of two rows (8 bf16 weights, or 16 int8 weights: two 8-input
// chunks of x) and dots them with every token. The first runs of weights (and
// the int8 row scales) are loaded before waiting for the previous kernel
// (nothing writes weights), and each round loads the next runs before using
// the current. int8 sums are scaled by their row's scale at the end. INT4
// weights have a kernel of their own (gemv_q4_kernel, below).
// Where the kernel's input comes from.
enum class In { bf16, rmsnorm, silu };

struct GemvIn {
  const __nv_bfloat16* x = nullptr;        // In::bf16: [T, k]
  const float* xf = nullptr;               // In::rmsnorm: [T, k]; In::silu: [T, stride]
  const __nv_bfloat16* norm_w = nullptr;   // In::rmsnorm
  float eps = 0.f;
  __nv_bfloat16* xn_out = nullptr;         // In::rmsnorm, optional
  int stride = 0;                          // In::silu
};

// An INT4 weight pair: one byte of codes (docs/int4-experts.md), the low
// nibble the even input.
struct Q4Pair {
  uint8_t codes;
};

// The weights as a GEMV kernel reads them.
struct GemvWeights {
  const void* w = nullptr;           // [n_out, k] bf16 or int8; INT4: codes [n_out, k/2]
  const float* row_scale = nullptr;  // int8: [n_out]
  const uint32_t* params = nullptr;  // INT4: half2 (scale, bias) [n_out, groups]
  int groups = 0;                    // INT4: groups a row
  int runs_per_group = 0;            // INT4: 32-input runs a group
};

// RMSNorm mode: inv[t] = 1 / rms(x_f32[t]) for the block (shared); a no-op
// for the other inputs.
template <int T, In MODE>
__device__ void rms_inverse(const GemvIn& in, int k, float* inv) {
  if constexpr (MODE == In::rmsnorm) {
    __shared__ float red[kWarps][T];
    float ss[T];
#pragma unroll
    for (int t = 0; t < T; ++t) ss[t] = 0.f;
    for (int i = threadIdx.x; i < k; i += kThreads)
#pragma unroll
      for (int t = 0; t < T; ++t) {
        const float v = in.xf[size_t(t) * k + i];
        ss[t] += v * v;
      }
#pragma unroll
    for (int t = 0; t < T; ++t) {
      const float v = detail::warp_sum(ss[t]);
      if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5][t] = v;
    }
    __syncthreads();
    if (threadIdx.x < T) {
      float sum = 0.f;
      for (int w = 0; w < kWarps; ++w) sum += red[w][threadIdx.x];
      inv[threadIdx.x] = rsqrtf(sum / float(k) + in.eps);
    }
    __syncthreads();
  }
}

using detail::bf16x8_to_float;

// Inputs i0..i0+7 of token t as bf16 (the values every weight type sees):
// 16 bytes, and in v the same values as floats.
template <In MODE>
__device__ __forceinline__ uint4 input_run(const GemvIn& in, int k, int t, int i0, const float* inv, float (&v)[8]) {
  uint4 u;
  if constexpr (MODE == In::bf16) {
    u = reinterpret_cast<const uint4*>(in.x + size_t(t) * k)[i0 / 8];
    bf16x8_to_float(u, v);
    return u;
  } else {
    if constexpr (MODE == In::rmsnorm) {
      const float* xr = in.xf + size_t(t) * k + i0;
#pragma unroll
      for (int e = 0; e < 8; ++e) v[e] = __bfloat162float(in.norm_w[i0 + e]) * (xr[e] * inv[t]);
    } else {
      const float* g = in.xf + size_t(t) * in.stride + i0;
#pragma unroll
      for (int e = 0; e < 8; ++e) v[e] = detail::silu(g[e]) * g[k + e];
    }
    __nv_bfloat162 b[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) b[e] = __floats2bfloat162_rn(v[2 * e], v[2 * e + 1]);
    memcpy(&u, b, 16);
    bf16x8_to_float(u, v);  // the rounded values, as the staged input holds them
    return u;
  }
}

template <int T, In MODE>
__device__ void stage_input(const GemvIn& in, int k, uint4* xs) {
  __shared__ float inv[T];
  rms_inverse<T, MODE>(in, k, inv);
  const int kc = k / 8;
  for (int c = threadIdx.x; c < T * kc; c += kThreads) {
    const int t = c / kc, i0 = (c % kc) * 8;
    float v[8];
    const uint4 u = input_run<MODE>(in, k, t, i0, inv, v);
    xs[c] = u;
    if (MODE == In::rmsnorm && in.xn_out && blockIdx.x == 0) reinterpret_cast<uint4*>(in.xn_out)[c] = u;
  }
}

// A warp's sums for its rows and every token, reduced over the lanes and
// written by lane 0: times the row's scale (int8 weights), times the token's
// gate, added to y or written.
template <int T>
__device__ __forceinline__ void store_rows(float (&acc)[kRowsPerWarp][T], int row0, int n_out, float* y,
                                           bool accumulate, const float* gate, int gate_stride,
                                           const float* row_scale) {
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r)
#pragma unroll
    for (int t = 0; t < T; ++t) acc[r][t] = detail::warp_sum(acc[r][t]);
  if ((threadIdx.x & 31) != 0) return;
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r) {
    if (row0 + r >= n_out) break;
#pragma unroll
    for (int t = 0; t < T; ++t) {
      float v = acc[r][t];
      if (row_scale) v *= row_scale[r];
      if (gate) v *= detail::sigmoid(gate[size_t(t) * gate_stride]);
      float* o = y + size_t(t) * n_out + row0 + r;
      *o = accumulate ? *o + v : v;
    }
  }
}

// How a 16-byte run of weights turns into floats: kChunks chunks of 8.
template <typename W>
struct WeightRun;

template <>
struct WeightRun<__nv_bfloat16> {
  static constexpr int kChunks = 1;
  __device__ __forceinline__ static void unpack(const uint4& v, int, float (&f)[8]) { bf16x8_to_float(v, f); }
};

template <>
struct WeightRun<int8_t> {
  static constexpr int kChunks = 2;
  // Chunk h is bytes [8h, 8h + 8).
  __device__ __forceinline__ static void unpack(const uint4& v, int h, float (&f)[8]) {
    detail::i8x4_to_floats(h ? v.z : v.x, f);
    detail::i8x4_to_floats(h ? v.w : v.y, f + 4);
  }
};

// INT4 codes for the prefill path's dequantisation (the GEMV below works in
// half2 instead).
template <>
struct WeightRun<Q4Pair> {
  // Chunk h is code bytes [4h, 4h + 4): inputs 8h..8h+7.
  __device__ __forceinline__ static void unpack(const uint4& v, int h, float (&f)[8]) {
    detail::q4_word_to_floats(h == 0 ? v.x : h == 1 ? v.y : h == 2 ? v.z : v.w, f);
  }
};

template <typename W, int T, In MODE>
__global__ void __launch_bounds__(kThreads)
    gemv_kernel(GemvWeights wa, GemvIn in, float* y, int n_out, int k, bool accumulate, const float* gate,
                int gate_stride) {
  constexpr bool kScaled = std::is_same_v<W, int8_t>;
  constexpr int kChunks = WeightRun<W>::kChunks;
  extern __shared__ uint4 xs[];  // [T, k/8]
  detail::allow_next_grid();
  const int kc = k / 8;        // 8-input chunks of x
  const int kw = kc / kChunks;  // 16-byte runs of a weight row
  const int lane = threadIdx.x & 31;
  const int row0 = (blockIdx.x * kWarps + (threadIdx.x >> 5)) * kRowsPerWarp;
  const uint4* wr[kRowsPerWarp];
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r)
    wr[r] = reinterpret_cast<const uint4*>(wa.w) + size_t(min(row0 + r, n_out - 1)) * kw;
  const bool active = row0 < n_out;
  float scale[kRowsPerWarp];
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r) scale[r] = 1.f;
  if constexpr (kScaled) {
#pragma unroll
    for (int r = 0; r < kRowsPerWarp; ++r)
      if (active) scale[r] = __ldg(wa.row_scale + min(row0 + r, n_out - 1));
  }
  uint4 cur[kRowsPerWarp][2];
  auto load = [&](uint4 (&dst)[kRowsPerWarp][2], int c0) {
#pragma unroll
    for (int u = 0; u < 2; ++u)
#pragma unroll
      for (int r = 0; r < kRowsPerWarp; ++r)
        if (active && c0 + 32 * u < kw) dst[r][u] = __ldcs(wr[r] + c0 + 32 * u);
  };
  load(cur, lane);
  detail::wait_prior_grid();
  stage_input<T, MODE>(in, k, xs);
  // Scales wait in shared memory, sparing registers in the main loop.
  __shared__ float scale_s[kWarps][kRowsPerWarp];
  if constexpr (kScaled) {
#pragma unroll
    for (int r = 0; r < kRowsPerWarp; ++r) scale_s[threadIdx.x >> 5][r] = scale[r];
  }
  __syncthreads();
  if (!active) return;
  float acc[kRowsPerWarp][T];
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r)
#pragma unroll
    for (int t = 0; t < T; ++t) acc[r][t] = 0.f;
  for (int c0 = lane; c0 < kw; c0 += 64) {
    uint4 nxt[kRowsPerWarp][2];
    load(nxt, c0 + 64);
#pragma unroll
    for (int u = 0; u < 2; ++u) {
      const int c = c0 + 32 * u;
      if (c >= kw) break;
#pragma unroll
      for (int h = 0; h < kChunks; ++h) {
        float wf[kRowsPerWarp][8];
#pragma unroll
        for (int r = 0; r < kRowsPerWarp; ++r) WeightRun<W>::unpack(cur[r][u], h, wf[r]);
#pragma unroll
        for (int t = 0; t < T; ++t) {
          const uint4 xv = xs[t * kc + c * kChunks + h];
          const __nv_bfloat162* b = reinterpret_cast<const __nv_bfloat162*>(&xv);
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const float2 f = __bfloat1622float2(b[e]);
#pragma unroll
            for (int r = 0; r < kRowsPerWarp; ++r) {
              acc[r][t] = fmaf(wf[r][2 * e], f.x, acc[r][t]);
              acc[r][t] = fmaf(wf[r][2 * e + 1], f.y, acc[r][t]);
            }
          }
        }
      }
    }
#pragma unroll
    for (int u = 0; u < 2; ++u)
#pragma unroll
      for (int r = 0; r < kRowsPerWarp; ++r) cur[r][u] = nxt[r][u];
  }
  store_rows<T>(acc, row0, n_out, y, accumulate, gate, gate_stride, kScaled ? scale_s[threadIdx.x >> 5] : nullptr);
}

template <typename W, int T, In MODE>
Status launch_gemv(const GemvWeights& wa, const GemvIn& in, float* y, int n_out, int k, bool acc,
                   const float* gate, int gate_stride, cudaStream_t stream) {
  const size_t smem = size_t(T) * k * 2;
  if (smem > 48 * 1024)
    MOE_CUDA_TRY(cudaFuncSetAttribute(gemv_kernel<W, T, MODE>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                      int(smem)));
  const int rows_per_block = kWarps * kRowsPerWarp;
  MOE_CUDA_TRY(detail::launch_pdl(gemv_kernel<W, T, MODE>, dim3((n_out + rows_per_block - 1) / rows_per_block),
                                  dim3(kThreads), smem, stream, wa, in, y, n_out, k, acc, gate, gate_stride));
  MOE_CUDA_LAUNCHED();
  return {};
}

// INT4 weights. Per 32-input chunk c of token t the input is staged as
// halves x / m (m = max |x| over the chunk, so |x / m| <= 1) with the
// chunk's m and sum of x beside it. A lane takes 16-byte runs of codes (one
// chunk, inside one group) of two rows; a code nibble becomes a half with
// one OR (0x6400 | n is 1024 + n) and a subtraction, and the chunk's dot
// product runs in half2 (each half lane sums 8 products of at most 15):
//   sum_i (n_i s + b) x_i = s m sum_i n_i (x_i / m) + b sum_i x_i,
// scale and bias applied in f32 per chunk. ~1e-3 relative against f32, as
// the expert GEMVs (q4_gemv.cu); a weight costs ~1.5 instructions plus one
// HFMA2 per two tokens, where unpacking to f32 cost ~5.
//
// Shared layout: halves [T][4][k/32] uint4 (word w of chunk c: inputs
// 8w..8w+7 as (x0,x4) (x1,x5) (x2,x6) (x3,x7), the order one 32-bit code word
// unpacks into), then (m, sum) [T][k/32] float2.

template <int T, In MODE>
__device__ void stage_q4_input(const GemvIn& in, int k, uint4* xh, float2* stats) {
  __shared__ float inv[T];
  rms_inverse<T, MODE>(in, k, inv);
  const int kc = k / 8, nchunks = k / 32;
  const int items = T * kc;
  // Four consecutive threads hold one chunk (8 inputs each); every lane of a
  // warp runs every round, for the shuffles.
  for (int r0 = 0; r0 < items; r0 += kThreads) {
    const int item = r0 + threadIdx.x;
    const bool on = item < items;
    float v[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    const int t = on ? item / kc : 0, i0 = on ? (item % kc) * 8 : 0;
    if (on) {
      const uint4 u = input_run<MODE>(in, k, t, i0, inv, v);
      if (MODE == In::rmsnorm && in.xn_out && blockIdx.x == 0) reinterpret_cast<uint4*>(in.xn_out)[item] = u;
    }
    float m = 0.f, sum = 0.f;
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      m = fmaxf(m, fabsf(v[e]));
      sum += v[e];
    }
#pragma unroll
    for (int o = 1; o < 4; o <<= 1) {
      m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
      sum += __shfl_xor_sync(0xffffffffu, sum, o);
    }
    if (on) {
      const float s = m > 1e-30f ? 1.f / m : 0.f;  // a chunk this small adds nothing; 1 / m would overflow
      const int c = i0 / 32, w = (i0 / 8) & 3;
      uint4 h;
      h.x = detail::half2_bits(__floats2half2_rn(v[0] * s, v[4] * s));
      h.y = detail::half2_bits(__floats2half2_rn(v[1] * s, v[5] * s));
      h.z = detail::half2_bits(__floats2half2_rn(v[2] * s, v[6] * s));
      h.w = detail::half2_bits(__floats2half2_rn(v[3] * s, v[7] * s));
      xh[(t * 4 + w) * nchunks + c] = h;
      if (w == 0) stats[t * nchunks + c] = make_float2(m, sum);
    }
  }
}

template <int T, In MODE>
__global__ void __launch_bounds__(kThreads)
    gemv_q4_kernel(GemvWeights wa, GemvIn in, float* y, int n_out, int k, bool accumulate, const float* gate,
                   int gate_stride, int group_shift) {
  extern __shared__ uint4 xh[];  // [T][4][k/32], then stats
  const int nchunks = k / 32;
  float2* stats = reinterpret_cast<float2*>(xh + size_t(T) * 4 * nchunks);
  detail::allow_next_grid();
  const int lane = threadIdx.x & 31;
  const int row0 = (blockIdx.x * kWarps + (threadIdx.x >> 5)) * kRowsPerWarp;
  const bool active = row0 < n_out;
  const uint4* wr[kRowsPerWarp];
  const uint32_t* pr[kRowsPerWarp];
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r) {
    const size_t row = size_t(min(row0 + r, n_out - 1));
    wr[r] = reinterpret_cast<const uint4*>(wa.w) + row * nchunks;
    pr[r] = wa.params + row * wa.groups;
  }
  uint4 cur[kRowsPerWarp][2];
  uint32_t pcur[kRowsPerWarp][2];
  auto load = [&](uint4 (&dst)[kRowsPerWarp][2], uint32_t (&pdst)[kRowsPerWarp][2], int c0) {
#pragma unroll
    for (int u = 0; u < 2; ++u)
#pragma unroll
      for (int r = 0; r < kRowsPerWarp; ++r)
        if (active && c0 + 32 * u < nchunks) {
          dst[r][u] = __ldcs(wr[r] + c0 + 32 * u);
          pdst[r][u] = __ldg(pr[r] + ((c0 + 32 * u) >> group_shift));
        }
  };
  load(cur, pcur, lane);  // weights before the wait: nothing writes them
  detail::wait_prior_grid();
  stage_q4_input<T, MODE>(in, k, xh, stats);
  __syncthreads();
  if (!active) return;
  float acc[kRowsPerWarp][T];
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r)
#pragma unroll
    for (int t = 0; t < T; ++t) acc[r][t] = 0.f;
  const half2 k1024 = __float2half2_rn(1024.f);
  for (int c0 = lane; c0 < nchunks; c0 += 64) {
    uint4 nxt[kRowsPerWarp][2];
    uint32_t pnxt[kRowsPerWarp][2];
    load(nxt, pnxt, c0 + 64);
#pragma unroll
    for (int u = 0; u < 2; ++u) {
      const int c = c0 + 32 * u;
      if (c >= nchunks) break;
      // The rows' codes as halves n (exact): word w, pair j.
      half2 q[kRowsPerWarp][4][4];
#pragma unroll
      for (int r = 0; r < kRowsPerWarp; ++r) {
        const uint32_t ws[4] = {cur[r][u].x, cur[r][u].y, cur[r][u].z, cur[r][u].w};
#pragma unroll
        for (int w = 0; w < 4; ++w)
#pragma unroll
          for (int j = 0; j < 4; ++j)
            q[r][w][j] = __hsub2(detail::as_half2(((ws[w] >> (4 * j)) & 0x000F000Fu) | 0x64006400u), k1024);
      }
      float2 sb[kRowsPerWarp];
#pragma unroll
      for (int r = 0; r < kRowsPerWarp; ++r) sb[r] = __half22float2(detail::as_half2(pcur[r][u]));
#pragma unroll
      for (int t = 0; t < T; ++t) {
        const float2 st = stats[t * nchunks + c];
        uint4 xv[4];
#pragma unroll
        for (int w = 0; w < 4; ++w) xv[w] = xh[(t * 4 + w) * nchunks + c];
#pragma unroll
        for (int r = 0; r < kRowsPerWarp; ++r) {
          half2 d0 = __float2half2_rn(0.f), d1 = d0;
#pragma unroll
          for (int w = 0; w < 4; ++w) {
            d0 = __hfma2(q[r][w][0], detail::as_half2(xv[w].x), d0);
            d1 = __hfma2(q[r][w][1], detail::as_half2(xv[w].y), d1);
            d0 = __hfma2(q[r][w][2], detail::as_half2(xv[w].z), d0);
            d1 = __hfma2(q[r][w][3], detail::as_half2(xv[w].w), d1);
          }
          const float2 a = __half22float2(d0), b = __half22float2(d1);
          const float dot = (a.x + a.y) + (b.x + b.y);
          acc[r][t] = fmaf(sb[r].x * st.x, dot, fmaf(sb[r].y, st.y, acc[r][t]));
        }
      }
    }
#pragma unroll
    for (int u = 0; u < 2; ++u)
#pragma unroll
      for (int r = 0; r < kRowsPerWarp; ++r) {
        cur[r][u] = nxt[r][u];
        pcur[r][u] = pnxt[r][u];
      }
  }
  store_rows<T>(acc, row0, n_out, y, accumulate, gate, gate_stride, nullptr);
}

// Shared bytes of the INT4 kernel's staged input, and the most it may take.
size_t q4_stage_bytes(int tokens, int k) { return size_t(tokens) * (k / 32) * (64 + 8); }
constexpr size_t kMaxStageBytes = 200 * 1024;

template <int T, In MODE>
Status launch_gemv_q4(const GemvWeights& wa, const GemvIn& in, float* y, int n_out, int k, bool acc,
                      const float* gate, int gate_stride, cudaStream_t stream) {
  const size_t smem = q4_stage_bytes(T, k);
  if (smem > 48 * 1024)
    MOE_CUDA_TRY(cudaFuncSetAttribute(gemv_q4_kernel<T, MODE>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                      int(smem)));
  int shift = 0;
  while ((1 << shift) < wa.runs_per_group) ++shift;
  const int rows_per_block = kWarps * kRowsPerWarp;
  MOE_CUDA_TRY(detail::launch_pdl(gemv_q4_kernel<T, MODE>, dim3((n_out + rows_per_block - 1) / rows_per_block),
                                  dim3(kThreads), smem, stream, wa, in, y, n_out, k, acc, gate, gate_stride, shift));
  MOE_CUDA_LAUNCHED();
  return {};
}

// Batched decode with INT8 weights on tensor cores. The FMA kernel above
// spends ~14 instructions a weight at 8 tokens (8 FMAs, the unpack, the
// inputs' conversion); here mma.sync m16n8k16 (bf16 in, f32 accumulate)
// takes a 16-row tile of weights as A and the tokens as B's 8 columns, so a
// weight costs its conversion to bf16 (exact: |q| <= 128) and 1/128 of an
// instruction. A block owns 16 rows; its 8 warps split K in 64-input chunks
// (chunk c to warp c mod 8) and add their tiles in shared memory at the end.
//
// The k order inside an mma is free as long as A and B agree: lane (g, t)
// of mma j takes inputs c*64 + 16t + 4j + {0,1,2,3}, which are one 32-bit
// word of its 16-byte run of weights (rows g and g+8) and two bf16 pairs of
// token g's staged input. Its A registers are (row g, inputs 0-1), (row
// g+8, 0-1), (row g, 2-3), (row g+8, 2-3) of those four and its B registers
// (inputs 0-1), (2-3) of token g: the fragment layout of m16n8k16 with
// logical k {2t, 2t+1, 2t+8, 2t+9} mapped onto them.
constexpr int kMmaWarps = 8;
constexpr int kMmaGroup = 4;  // chunks whose weights a warp loads together

__device__ __forceinline__ uint32_t i8pair_to_bf16x2(uint32_t word, int half) {
  const uint32_t biased = word ^ 0x80808080u;
  const float lo = __uint_as_float(__byte_perm(biased, 0x4B000000u, 0x7440u + 2 * half)) - 8388736.f;
  const float hi = __uint_as_float(__byte_perm(biased, 0x4B000000u, 0x7441u + 2 * half)) - 8388736.f;
  const __nv_bfloat162 b = __floats2bfloat162_rn(lo, hi);
  uint32_t u;
  memcpy(&u, &b, 4);
  return u;
}

template <int T>
__global__ void __launch_bounds__(kMmaWarps * 32)
    gemv_i8_mma_kernel(const int8_t* __restrict__ w, const __nv_bfloat16* __restrict__ x, float* y, int n_out,
                       int k, bool accumulate, const float* gate, int gate_stride,
                       const float* __restrict__ row_scale) {
  extern __shared__ uint4 xs[];  // [T, k/8 + 1]: a padded row spreads the tokens over the banks
  __shared__ float part[kMmaWarps][16][8];
  detail::allow_next_grid();
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t4 = lane & 3;
  const int row0 = blockIdx.x * 16;
  const int kc = k / 8, runs = k / 16, chunks = k / 64;
  const uint4* wa = reinterpret_cast<const uint4*>(w) + size_t(min(row0 + g, n_out - 1)) * runs + t4;
  const uint4* wb = reinterpret_cast<const uint4*>(w) + size_t(min(row0 + g + 8, n_out - 1)) * runs + t4;
  uint4 pa[kMmaGroup], pb[kMmaGroup];
  auto load = [&](int c0) {
#pragma unroll
    for (int i = 0; i < kMmaGroup; ++i) {
      const int c = c0 + i * kMmaWarps;
      if (c < chunks) {
        pa[i] = __ldcs(wa + size_t(c) * 4);
        pb[i] = __ldcs(wb + size_t(c) * 4);
      }
    }
  };
  load(warp);  // weights before the wait: nothing writes them
  detail::wait_prior_grid();
  const uint4* xg = reinterpret_cast<const uint4*>(x);
  for (int i = threadIdx.x; i < T * kc; i += kMmaWarps * 32) {
    const int t = i / kc;
    xs[t * (kc + 1) + (i - t * kc)] = xg[i];
  }
  __syncthreads();
  float acc[4] = {0.f, 0.f, 0.f, 0.f};
  for (int c0 = warp; c0 < chunks; c0 += kMmaWarps * kMmaGroup) {
    if (c0 != warp) load(c0);
#pragma unroll
    for (int i = 0; i < kMmaGroup; ++i) {
      const int c = c0 + i * kMmaWarps;
      if (c >= chunks) break;
      uint4 x0 = make_uint4(0, 0, 0, 0), x1 = x0;
      if (g < T) {
        const uint4* xr = xs + g * (kc + 1) + c * 8 + 2 * t4;
        x0 = xr[0];
        x1 = xr[1];
      }
      const uint32_t ra[4] = {pa[i].x, pa[i].y, pa[i].z, pa[i].w};
      const uint32_t rb[4] = {pb[i].x, pb[i].y, pb[i].z, pb[i].w};
      const uint32_t xw[8] = {x0.x, x0.y, x0.z, x0.w, x1.x, x1.y, x1.z, x1.w};
#pragma unroll
      for (int j = 0; j < 4; ++j)
        detail::mma_bf16_16816(acc, i8pair_to_bf16x2(ra[j], 0), i8pair_to_bf16x2(rb[j], 0), i8pair_to_bf16x2(ra[j], 1),
                       i8pair_to_bf16x2(rb[j], 1), xw[2 * j], xw[2 * j + 1]);
    }
  }
  // d0, d1: row g, tokens 2t4 and 2t4+1; d2, d3: row g+8, the same tokens.
  part[warp][g][2 * t4] = acc[0];
  part[warp][g][2 * t4 + 1] = acc[1];
  part[warp][g + 8][2 * t4] = acc[2];
  part[warp][g + 8][2 * t4 + 1] = acc[3];
  __syncthreads();
  if (threadIdx.x < 128) {
    const int r = threadIdx.x >> 3, t = threadIdx.x & 7;
    const int row = row0 + r;
    if (t < T && row < n_out) {
      float v = 0.f;
#pragma unroll
      for (int wi = 0; wi < kMmaWarps; ++wi) v += part[wi][r][t];
      v *= __ldg(row_scale + row);
      if (gate) v *= detail::sigmoid(gate[size_t(t) * gate_stride]);
      float* o = y + size_t(t) * n_out + row;
      *o = accumulate ? *o + v : v;
    }
  }
}

template <int T>
Status launch_gemv_i8_mma(const int8_t* w, const float* row_scale, const __nv_bfloat16* x, float* y, int n_out,
                          int k, bool acc, const float* gate, int gate_stride, cudaStream_t stream) {
  const size_t smem = size_t(T) * (k / 8 + 1) * 16;
  if (smem > 48 * 1024)
    MOE_CUDA_TRY(cudaFuncSetAttribute(gemv_i8_mma_kernel<T>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                      int(smem)));
  MOE_CUDA_TRY(detail::launch_pdl(gemv_i8_mma_kernel<T>, dim3((n_out + 15) / 16), dim3(kMmaWarps * 32), smem,
                                  stream, w, x, y, n_out, k, acc, gate, gate_stride, row_scale));
  MOE_CUDA_LAUNCHED();
  return {};
}

template <In MODE, typename W>
Status gemv_dispatch(const GemvWeights& wa, const GemvIn& in, float* y, int tokens, int n_out, int k,
                     bool accumulate, const float* gate_logits, int gate_stride, cudaStream_t stream) {
  constexpr bool kScaled = std::is_same_v<W, int8_t>;
  constexpr bool kQ4 = std::is_same_v<W, Q4Pair>;
  MOE_CUDA_REQUIRE(wa.w && y, "null pointer");
  MOE_CUDA_REQUIRE(!kScaled || wa.row_scale, "row_scale must be given with int8 weights");
  MOE_CUDA_REQUIRE(tokens >= 1 && tokens <= kGemvMaxTokens, "tokens must be in [1, 8]");
  if constexpr (kScaled)
    MOE_CUDA_REQUIRE(n_out > 0 && k > 0 && k % 16 == 0, "k must be a positive multiple of 16 (int8 weights)");
  else if constexpr (kQ4)
    MOE_CUDA_REQUIRE(n_out > 0 && k > 0 && k % 32 == 0 && wa.params && wa.runs_per_group > 0 &&
                         (wa.runs_per_group & (wa.runs_per_group - 1)) == 0 &&
                         wa.groups * wa.runs_per_group * 32 == k,
                     "INT4 weights need k a positive multiple of 32 and groups of a power-of-two multiple of 32 "
                     "inputs");
  else
    MOE_CUDA_REQUIRE(n_out > 0 && k > 0 && k % 8 == 0, "k must be a positive multiple of 8");
  MOE_CUDA_REQUIRE((kQ4 ? q4_stage_bytes(tokens, k) : size_t(tokens) * k * 2) <= kMaxStageBytes,
                   "tokens * k too large for shared memory");
  MOE_CUDA_REQUIRE(reinterpret_cast<uintptr_t>(wa.w) % 16 == 0, "w must be 16-byte aligned");
  MOE_CUDA_REQUIRE(reinterpret_cast<uintptr_t>(wa.params) % 4 == 0, "INT4 params must be 4-byte aligned");
  // 5 to 8 tokens of INT8 weights and a plain input: tensor cores.
  if constexpr (kScaled && MODE == In::bf16) {
    const auto* w = static_cast<const int8_t*>(wa.w);
    const float* row_scale = wa.row_scale;
    if (tokens >= 5 && k % 64 == 0 && size_t(tokens) * (k / 8 + 1) * 16 <= 200 * 1024) {
      switch (tokens) {
        case 5: return launch_gemv_i8_mma<5>(w, row_scale, in.x, y, n_out, k, accumulate, gate_logits, gate_stride, stream);
        case 6: return launch_gemv_i8_mma<6>(w, row_scale, in.x, y, n_out, k, accumulate, gate_logits, gate_stride, stream);
        case 7: return launch_gemv_i8_mma<7>(w, row_scale, in.x, y, n_out, k, accumulate, gate_logits, gate_stride, stream);
        default: return launch_gemv_i8_mma<8>(w, row_scale, in.x, y, n_out, k, accumulate, gate_logits, gate_stride, stream);
      }
    }
  }
  if constexpr (kQ4) {
    switch (tokens) {
#define MOE_GEMV_Q4_CASE(T) \
  case T: return launch_gemv_q4<T, MODE>(wa, in, y, n_out, k, accumulate, gate_logits, gate_stride, stream);
      MOE_GEMV_Q4_CASE(1) MOE_GEMV_Q4_CASE(2) MOE_GEMV_Q4_CASE(3) MOE_GEMV_Q4_CASE(4)
      MOE_GEMV_Q4_CASE(5) MOE_GEMV_Q4_CASE(6) MOE_GEMV_Q4_CASE(7) MOE_GEMV_Q4_CASE(8)
#undef MOE_GEMV_Q4_CASE
    }
    return make_error("dense_gemv: unreachable token count");
  } else {
    switch (tokens) {
#define MOE_GEMV_CASE(T) \
  case T: return launch_gemv<W, T, MODE>(wa, in, y, n_out, k, accumulate, gate_logits, gate_stride, stream);
      MOE_GEMV_CASE(1) MOE_GEMV_CASE(2) MOE_GEMV_CASE(3) MOE_GEMV_CASE(4)
      MOE_GEMV_CASE(5) MOE_GEMV_CASE(6) MOE_GEMV_CASE(7) MOE_GEMV_CASE(8)
#undef MOE_GEMV_CASE
    }
    return make_error("dense_gemv: unreachable token count");
  }
}

// The three inputs, for either weight type.
template <typename W>
Status gemv_bf16_in(const GemvWeights& w, const __nv_bfloat16* x, float* y, int tokens, int n_out,
                    int k, bool accumulate, const float* gate_logits, int gate_stride, cudaStream_t stream) {
  MOE_CUDA_REQUIRE(x && reinterpret_cast<uintptr_t>(x) % 16 == 0, "x must be non-null and 16-byte aligned");
  GemvIn in;
  in.x = x;
  return gemv_dispatch<In::bf16, W>(w, in, y, tokens, n_out, k, accumulate, gate_logits, gate_stride,
                                 stream);
}

template <typename W>
Status gemv_rmsnorm_in(const GemvWeights& w, const float* x_f32, const __nv_bfloat16* norm_w,
                       float eps, __nv_bfloat16* xn_out, float* y, int tokens, int n_out, int k, bool accumulate,
                       const float* gate_logits, int gate_stride, cudaStream_t stream) {
  MOE_CUDA_REQUIRE(x_f32 && norm_w, "null pointer");
  MOE_CUDA_REQUIRE(reinterpret_cast<uintptr_t>(xn_out) % 16 == 0, "xn_out must be 16-byte aligned");
  MOE_CUDA_REQUIRE(!(accumulate && y == x_f32), "y must not alias x_f32 when accumulating");
  GemvIn in;
  in.xf = x_f32;
  in.norm_w = norm_w;
  in.eps = eps;
  in.xn_out = xn_out;
  return gemv_dispatch<In::rmsnorm, W>(w, in, y, tokens, n_out, k, accumulate, gate_logits, gate_stride,
                                    stream);
}

template <typename W>
Status gemv_silu_in(const GemvWeights& w, const float* gate_up, int gate_up_stride, float* y,
                    int tokens, int n_out, int k, bool accumulate, const float* gate_logits, int gate_stride,
                    cudaStream_t stream) {
  MOE_CUDA_REQUIRE(gate_up && gate_up_stride >= 2 * k, "gate_up null or its stride below 2 k");
  GemvIn in;
  in.xf = gate_up;
  in.stride = gate_up_stride;
  return gemv_dispatch<In::silu, W>(w, in, y, tokens, n_out, k, accumulate, gate_logits, gate_stride,
                                 stream);
}

constexpr int kQuantThreads = 256;

// A block per row: the row's largest |w| sets the scale, then every weight is
// rounded (to nearest, ties to even) in units of it. An all-zero row gets
// scale 0 and zeros.
__global__ void __launch_bounds__(kQuantThreads)
    quantize_rows_kernel(const __nv_bfloat16* __restrict__ w, int k, int8_t* __restrict__ q,
                         float* __restrict__ row_scale) {
  __shared__ float red[kQuantThreads / 32];
  detail::allow_next_grid();
  detail::wait_prior_grid();
  const size_t base = size_t(blockIdx.x) * k;
  float m = 0.f;
  for (int i = threadIdx.x; i < k; i += kQuantThreads) m = fmaxf(m, fabsf(__bfloat162float(w[base + i])));
  m = detail::warp_max(m);
  if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = m;
  __syncthreads();
  m = 0.f;
#pragma unroll
  for (int i = 0; i < kQuantThreads / 32; ++i) m = fmaxf(m, red[i]);
  const float scale = m / 127.f;
  if (threadIdx.x == 0) row_scale[blockIdx.x] = scale;
  for (int i = threadIdx.x; i < k; i += kQuantThreads) {
    const float v = scale > 0.f ? rintf(__bfloat162float(w[base + i]) / scale) : 0.f;
    q[base + i] = int8_t(fminf(fmaxf(v, -127.f), 127.f));
  }
}

// out[r, i] = bf16(row_scale[r] * q[r, i]); a thread per 8 weights when
// rows are whole 8-byte runs, else a thread per weight.
__global__ void dequantize_rows_kernel(const int8_t* __restrict__ q, const float* __restrict__ row_scale, int k,
                                       size_t count, bool runs, __nv_bfloat16* __restrict__ out) {
  detail::allow_next_grid();
  detail::wait_prior_grid();
  const size_t stride = size_t(gridDim.x) * blockDim.x;
  if (runs) {
    const int kr = k / 8;
    for (size_t c = size_t(blockIdx.x) * blockDim.x + threadIdx.x; c < count; c += stride) {
      const float s = row_scale[c / kr];
      const uint2 v = reinterpret_cast<const uint2*>(q)[c];
      const uint32_t words[2] = {v.x, v.y};
      __nv_bfloat162 b[4];
#pragma unroll
      for (int j = 0; j < 2; ++j)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const float lo = float(int8_t(words[j] >> (16 * e)));
          const float hi = float(int8_t(words[j] >> (16 * e + 8)));
          b[2 * j + e] = __floats2bfloat162_rn(s * lo, s * hi);
        }
      uint4 u;
      memcpy(&u, b, 16);
      reinterpret_cast<uint4*>(out)[c] = u;
    }
  } else {
    for (size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < count; i += stride)
      out[i] = __float2bfloat16_rn(row_scale[i / k] * float(q[i]));
  }
}

// out[r, i] = bf16(code * scale + bias) of an INT4 matrix: a thread per
// 16-byte run of codes (32 weights, one group's), written as four 16-byte
// runs of bf16.
__global__ void dequantize_q4_kernel(const uint4* __restrict__ codes, const uint32_t* __restrict__ params,
                                     int runs_per_row, int runs_per_group, size_t count, uint4* __restrict__ out) {
  detail::allow_next_grid();
  detail::wait_prior_grid();
  const size_t stride = size_t(gridDim.x) * blockDim.x;
  const int groups = runs_per_row / runs_per_group;
  for (size_t c = size_t(blockIdx.x) * blockDim.x + threadIdx.x; c < count; c += stride) {
    const size_t row = c / runs_per_row;
    const int run = int(c - row * runs_per_row);
    __half2 p;
    const uint32_t pw = params[row * groups + run / runs_per_group];
    memcpy(&p, &pw, 4);
    const float2 sb = __half22float2(p);
    const uint4 v = codes[c];
#pragma unroll
    for (int h = 0; h < 4; ++h) {
      float f[8];
      WeightRun<Q4Pair>::unpack(v, h, f);
      __nv_bfloat162 b[4];
#pragma unroll
      for (int e = 0; e < 4; ++e)
        b[e] = __floats2bfloat162_rn(fmaf(f[2 * e], sb.x, sb.y), fmaf(f[2 * e + 1], sb.x, sb.y));
      uint4 u;
      memcpy(&u, b, 16);
      out[c * 4 + h] = u;
    }
  }
}

GemvWeights bf16_weights(const __nv_bfloat16* w) {
  GemvWeights g;
  g.w = w;
  return g;
}

GemvWeights i8_weights(const int8_t* w, const float* row_scale) {
  GemvWeights g;
  g.w = w;
  g.row_scale = row_scale;
  return g;
}

// An INT4 matrix of `blob`; shapes the kernels cannot take leave params null
// (the dispatcher refuses it).
GemvWeights q4_weights(const uint8_t* blob, const Q4MatrixLayout& m) {
  GemvWeights g;
  if (!blob) return g;
  g.w = blob + m.codes_offset;
  if (m.group % 32 == 0 && m.group > 0 && m.cols % m.group == 0) {
    g.params = reinterpret_cast<const uint32_t*>(blob + m.params_offset);
    g.groups = m.cols / m.group;
    g.runs_per_group = m.group / 32;
  }
  return g;
}

}  // namespace

Status dense_gemv_bf16(const __nv_bfloat16* w, const __nv_bfloat16* x, float* y, int tokens, int n_out, int k,
                       bool accumulate, const float* gate_logits, int gate_stride, cudaStream_t stream) {
  return gemv_bf16_in<__nv_bfloat16>(bf16_weights(w), x, y, tokens, n_out, k, accumulate, gate_logits,
                                     gate_stride, stream);
}

Status dense_gemv_bf16_rmsnorm(const __nv_bfloat16* w, const float* x_f32, const __nv_bfloat16* norm_w, float eps,
                               __nv_bfloat16* xn_out, float* y, int tokens, int n_out, int k, bool accumulate,
                               const float* gate_logits, int gate_stride, cudaStream_t stream) {
  return gemv_rmsnorm_in<__nv_bfloat16>(bf16_weights(w), x_f32, norm_w, eps, xn_out, y, tokens, n_out, k,
                                        accumulate, gate_logits, gate_stride, stream);
}

Status dense_gemv_bf16_silu(const __nv_bfloat16* w, const float* gate_up, int gate_up_stride, float* y, int tokens,
                            int n_out, int k, bool accumulate, const float* gate_logits, int gate_stride,
                            cudaStream_t stream) {
  return gemv_silu_in<__nv_bfloat16>(bf16_weights(w), gate_up, gate_up_stride, y, tokens, n_out, k, accumulate,
                                     gate_logits, gate_stride, stream);
}

Status dense_gemv_i8(const int8_t* w, const float* row_scale, const __nv_bfloat16* x, float* y, int tokens,
                     int n_out, int k, bool accumulate, const float* gate_logits, int gate_stride,
                     cudaStream_t stream) {
  return gemv_bf16_in<int8_t>(i8_weights(w, row_scale), x, y, tokens, n_out, k, accumulate, gate_logits,
                              gate_stride, stream);
}

Status dense_gemv_i8_rmsnorm(const int8_t* w, const float* row_scale, const float* x_f32,
                             const __nv_bfloat16* norm_w, float eps, __nv_bfloat16* xn_out, float* y, int tokens,
                             int n_out, int k, bool accumulate, const float* gate_logits, int gate_stride,
                             cudaStream_t stream) {
  return gemv_rmsnorm_in<int8_t>(i8_weights(w, row_scale), x_f32, norm_w, eps, xn_out, y, tokens, n_out, k,
                                 accumulate, gate_logits, gate_stride, stream);
}

Status dense_gemv_i8_silu(const int8_t* w, const float* row_scale, const float* gate_up, int gate_up_stride,
                          float* y, int tokens, int n_out, int k, bool accumulate, const float* gate_logits,
                          int gate_stride, cudaStream_t stream) {
  return gemv_silu_in<int8_t>(i8_weights(w, row_scale), gate_up, gate_up_stride, y, tokens, n_out, k, accumulate,
                              gate_logits, gate_stride, stream);
}

int dense_gemv_q4_max_k(int tokens) {
  return int(kMaxStageBytes / (size_t(std::max(tokens, 1)) * (64 + 8))) * 32;
}

Status dense_gemv_q4(const uint8_t* blob, const Q4MatrixLayout& m, const __nv_bfloat16* x, float* y, int tokens,
                     bool accumulate, const float* gate_logits, int gate_stride, cudaStream_t stream) {
  return gemv_bf16_in<Q4Pair>(q4_weights(blob, m), x, y, tokens, m.rows, m.cols, accumulate, gate_logits,
                              gate_stride, stream);
}

Status dense_gemv_q4_rmsnorm(const uint8_t* blob, const Q4MatrixLayout& m, const float* x_f32,
                             const __nv_bfloat16* norm_w, float eps, __nv_bfloat16* xn_out, float* y, int tokens,
                             bool accumulate, const float* gate_logits, int gate_stride, cudaStream_t stream) {
  return gemv_rmsnorm_in<Q4Pair>(q4_weights(blob, m), x_f32, norm_w, eps, xn_out, y, tokens, m.rows, m.cols,
                                 accumulate, gate_logits, gate_stride, stream);
}

Status dense_gemv_q4_silu(const uint8_t* blob, const Q4MatrixLayout& m, const float* gate_up, int gate_up_stride,
                          float* y, int tokens, bool accumulate, const float* gate_logits, int gate_stride,
                          cudaStream_t stream) {
  return gemv_silu_in<Q4Pair>(q4_weights(blob, m), gate_up, gate_up_stride, y, tokens, m.rows, m.cols,
                              accumulate, gate_logits, gate_stride, stream);
}

Status quantize_rows_i8(const __nv_bfloat16* w, int n_out, int k, int8_t* q, float* row_scale,
                        cudaStream_t stream) {
  MOE_CUDA_REQUIRE(w && q && row_scale, "null pointer");
  MOE_CUDA_REQUIRE(n_out > 0 && k > 0, "shape must be positive");
  quantize_rows_kernel<<<n_out, kQuantThreads, 0, stream>>>(w, k, q, row_scale);
  MOE_CUDA_LAUNCHED();
  return {};
}

Status dequantize_q4(const uint8_t* blob, const Q4MatrixLayout& m, __nv_bfloat16* out, cudaStream_t stream) {
  const GemvWeights g = q4_weights(blob, m);
  MOE_CUDA_REQUIRE(blob && out, "null pointer");
  MOE_CUDA_REQUIRE(m.rows > 0 && m.cols > 0 && m.cols % 32 == 0 && g.params,
                   "INT4 dequantisation needs cols a positive multiple of 32 and groups of a multiple of 32");
  MOE_CUDA_REQUIRE(reinterpret_cast<uintptr_t>(g.w) % 16 == 0 && reinterpret_cast<uintptr_t>(out) % 16 == 0 &&
                       reinterpret_cast<uintptr_t>(g.params) % 4 == 0,
                   "codes and out must be 16-byte aligned, params 4-byte");
  const size_t count = size_t(m.rows) * (m.cols / 32);
  const int threads = 256;
  const int blocks = int(std::min<size_t>((count + threads - 1) / threads, 65536));
  dequantize_q4_kernel<<<blocks, threads, 0, stream>>>(static_cast<const uint4*>(g.w), g.params, m.cols / 32,
                                                       g.runs_per_group, count, reinterpret_cast<uint4*>(out));
  MOE_CUDA_LAUNCHED();
  return {};
}

Status dequantize_rows_i8(const int8_t* q, const float* row_scale, int n_out, int k, __nv_bfloat16* out,
                          cudaStream_t stream) {
  MOE_CUDA_REQUIRE(q && row_scale && out, "null pointer");
  MOE_CUDA_REQUIRE(n_out > 0 && k > 0, "shape must be positive");
  const bool runs = k % 8 == 0 && reinterpret_cast<uintptr_t>(q) % 8 == 0 &&
                    reinterpret_cast<uintptr_t>(out) % 16 == 0;
  const size_t count = size_t(n_out) * k / (runs ? 8 : 1);
  const int threads = 256;
  const int blocks = int(std::min<size_t>((count + threads - 1) / threads, 65536));
  dequantize_rows_kernel<<<blocks, threads, 0, stream>>>(q, row_scale, k, count, runs, out);
  MOE_CUDA_LAUNCHED();
  return {};
}

Result<CublasLtMatmul*> CublasLtMatmul::create(size_t workspace_bytes) {
  auto* m = new CublasLtMatmul();
  auto fail = [&](Error e) -> Result<CublasLtMatmul*> {
    delete m;
    return e;
  };
  if (cublasStatus_t s = cublasLtCreate(&m->handle_); s != CUBLAS_STATUS_SUCCESS)
    return fail(make_error(std::string("cublasLtCreate: ") + cublas_status_name(s)));
  if (cudaError_t e = cudaMalloc(&m->workspace_, workspace_bytes); e != cudaSuccess)
    return fail(make_error(std::string("cuBLASLt workspace: ") + cudaGetErrorString(e)));
  m->workspace_bytes_ = workspace_bytes;
  return m;
}

CublasLtMatmul::~CublasLtMatmul() {
  if (workspace_) cudaFree(workspace_);
  if (handle_) cublasLtDestroy(handle_);
}

// Row-major y[m, n] = x[m, k] W[n, k]^T is column-major y^T[n, m] =
// op_T(W: k x n, ld k) * x (k x m, ld k).
Status CublasLtMatmul::matmul(const __nv_bfloat16* x, const __nv_bfloat16* w, void* y, bool y_f32, int m, int n,
                              int k, float beta, cudaStream_t stream) {
  MOE_CUDA_REQUIRE(x && w && y, "null pointer");
  MOE_CUDA_REQUIRE(m > 0 && n > 0 && k > 0, "shape must be positive");
  const cudaDataType_t yt = y_f32 ? CUDA_R_32F : CUDA_R_16BF;
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t la = nullptr, lb = nullptr, lc = nullptr;
  Status st;
  auto body = [&]() -> Status {
    MOE_CUBLAS_TRY(cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    const cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
    MOE_CUBLAS_TRY(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta)));
    MOE_CUBLAS_TRY(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb)));
    MOE_CUBLAS_TRY(cublasLtMatrixLayoutCreate(&la, CUDA_R_16BF, k, n, k));
    MOE_CUBLAS_TRY(cublasLtMatrixLayoutCreate(&lb, CUDA_R_16BF, k, m, k));
    MOE_CUBLAS_TRY(cublasLtMatrixLayoutCreate(&lc, yt, n, m, n));
    const auto key = std::make_tuple(m, n, k, y_f32, beta != 0.f);
    auto it = algos_.find(key);
    if (it == algos_.end()) {
      cublasLtMatmulPreference_t pref = nullptr;
      MOE_CUBLAS_TRY(cublasLtMatmulPreferenceCreate(&pref));
      cublasStatus_t s = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                              &workspace_bytes_, sizeof(workspace_bytes_));
      cublasLtMatmulHeuristicResult_t res{};
      int found = 0;
      if (s == CUBLAS_STATUS_SUCCESS)
        s = cublasLtMatmulAlgoGetHeuristic(handle_, op, la, lb, lc, lc, pref, 1, &res, &found);
      cublasLtMatmulPreferenceDestroy(pref);
      MOE_CUBLAS_TRY(s);
      MOE_CUDA_REQUIRE(found > 0, "cuBLASLt found no algorithm for this shape");
      it = algos_.emplace(key, res.algo).first;
    }
    const float alpha = 1.f;
    MOE_CUBLAS_TRY(cublasLtMatmul(handle_, op, &alpha, w, la, x, lb, &beta, y, lc, y, lc, &it->second,
                                  workspace_, workspace_bytes_, stream));
    return {};
  };
  st = body();
  if (lc) cublasLtMatrixLayoutDestroy(lc);
  if (lb) cublasLtMatrixLayoutDestroy(lb);
  if (la) cublasLtMatrixLayoutDestroy(la);
  if (op) cublasLtMatmulDescDestroy(op);
  return st;
}

}  // namespace moe::cuda
