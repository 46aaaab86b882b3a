#include "kernels/cuda/cuda_check.cuh"
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/dense_matmul.cuh"
#include "kernels/cuda/device_math.cuh"

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
// the current. int8 sums are scaled by their row's scale at the end.
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

template <int T, In MODE>
__device__ void stage_input(const GemvIn& in, int k, uint4* xs) {
  const int kc = k / 8;
  if constexpr (MODE == In::bf16) {
    const uint4* xg = reinterpret_cast<const uint4*>(in.x);
    for (int i = threadIdx.x; i < T * kc; i += kThreads) xs[i] = xg[i];
  } else {
    __shared__ float red[kWarps][T];
    __shared__ float inv[T];
    if constexpr (MODE == In::rmsnorm) {
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
    for (int c = threadIdx.x; c < T * kc; c += kThreads) {
      const int t = c / kc, i0 = (c % kc) * 8;
      float v[8];
      if constexpr (MODE == In::rmsnorm) {
        const float* xr = in.xf + size_t(t) * k + i0;
#pragma unroll
        for (int e = 0; e < 8; ++e) v[e] = __bfloat162float(in.norm_w[i0 + e]) * (xr[e] * inv[t]);
      } else {
        const float* g = in.xf + size_t(t) * in.stride + i0;
#pragma unroll
        for (int e = 0; e < 8; ++e) v[e] = detail::silu(g[e]) * g[k + e];
      }
      uint4 u;
      __nv_bfloat162 b[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) b[e] = __floats2bfloat162_rn(v[2 * e], v[2 * e + 1]);
      memcpy(&u, b, 16);
      xs[c] = u;
      if (MODE == In::rmsnorm && in.xn_out && blockIdx.x == 0) reinterpret_cast<uint4*>(in.xn_out)[c] = u;
    }
  }
}

// How a 16-byte run of weights turns into floats: kChunks chunks of 8.
template <typename W>
struct WeightRun;

template <>
struct WeightRun<__nv_bfloat16> {
  static constexpr int kChunks = 1;
  __device__ __forceinline__ static void unpack(const uint4& v, int, float (&f)[8]) {
    const __nv_bfloat162* b = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const float2 p = __bfloat1622float2(b[e]);
      f[2 * e] = p.x;
      f[2 * e + 1] = p.y;
    }
  }
};

template <>
struct WeightRun<int8_t> {
  static constexpr int kChunks = 2;
  // Chunk h is bytes [8h, 8h + 8). Each signed byte q, biased to q + 128,
  // becomes the low mantissa byte of 2^23 (0x4B000000); subtracting
  // 2^23 + 128 leaves q exactly.
  __device__ __forceinline__ static void unpack(const uint4& v, int h, float (&f)[8]) {
    const uint32_t words[2] = {(h ? v.z : v.x) ^ 0x80808080u, (h ? v.w : v.y) ^ 0x80808080u};
#pragma unroll
    for (int j = 0; j < 2; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e)
        f[4 * j + e] = __uint_as_float(__byte_perm(words[j], 0x4B000000u, 0x7440u + e)) - 8388736.f;
  }
};

template <typename W, int T, In MODE>
__global__ void __launch_bounds__(kThreads)
    gemv_kernel(const W* __restrict__ w, GemvIn in, float* y, int n_out, int k, bool accumulate,
                const float* gate, int gate_stride, const float* __restrict__ row_scale) {
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
    wr[r] = reinterpret_cast<const uint4*>(w + size_t(min(row0 + r, n_out - 1)) * k);
  const bool active = row0 < n_out;
  float scale[kRowsPerWarp];
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r) scale[r] = 1.f;
  if constexpr (kScaled) {
#pragma unroll
    for (int r = 0; r < kRowsPerWarp; ++r)
      if (active) scale[r] = __ldg(row_scale + min(row0 + r, n_out - 1));
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
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r)
#pragma unroll
    for (int t = 0; t < T; ++t) acc[r][t] = detail::warp_sum(acc[r][t]);
  if (lane == 0) {
#pragma unroll
    for (int r = 0; r < kRowsPerWarp; ++r) {
      if (row0 + r >= n_out) break;
#pragma unroll
      for (int t = 0; t < T; ++t) {
        float v = acc[r][t];
        if constexpr (kScaled) v *= scale_s[threadIdx.x >> 5][r];
        if (gate) v *= detail::sigmoid(gate[size_t(t) * gate_stride]);
        float* o = y + size_t(t) * n_out + row0 + r;
        *o = accumulate ? *o + v : v;
      }
    }
  }
}

template <typename W, int T, In MODE>
Status launch_gemv(const W* w, const float* row_scale, const GemvIn& in, float* y, int n_out, int k, bool acc,
                   const float* gate, int gate_stride, cudaStream_t stream) {
  const size_t smem = size_t(T) * k * 2;
  if (smem > 48 * 1024)
    MOE_CUDA_TRY(cudaFuncSetAttribute(gemv_kernel<W, T, MODE>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                      int(smem)));
  const int rows_per_block = kWarps * kRowsPerWarp;
  MOE_CUDA_TRY(detail::launch_pdl(gemv_kernel<W, T, MODE>, dim3((n_out + rows_per_block - 1) / rows_per_block),
                                  dim3(kThreads), smem, stream, w, in, y, n_out, k, acc, gate, gate_stride,
                                  row_scale));
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
        mma_bf16_16816(acc, i8pair_to_bf16x2(ra[j], 0), i8pair_to_bf16x2(rb[j], 0), i8pair_to_bf16x2(ra[j], 1),
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

// row_scale: [n_out] for int8 weights, null for bf16.
template <In MODE, typename W>
Status gemv_dispatch(const W* w, const float* row_scale, const GemvIn& in, float* y, int tokens, int n_out, int k,
                     bool accumulate, const float* gate_logits, int gate_stride, cudaStream_t stream) {
  constexpr bool kScaled = std::is_same_v<W, int8_t>;
  MOE_CUDA_REQUIRE(w && y, "null pointer");
  MOE_CUDA_REQUIRE(!kScaled || row_scale, "row_scale must be given with int8 weights");
  MOE_CUDA_REQUIRE(tokens >= 1 && tokens <= kGemvMaxTokens, "tokens must be in [1, 8]");
  if constexpr (kScaled)
    MOE_CUDA_REQUIRE(n_out > 0 && k > 0 && k % 16 == 0, "k must be a positive multiple of 16 (int8 weights)");
  else
    MOE_CUDA_REQUIRE(n_out > 0 && k > 0 && k % 8 == 0, "k must be a positive multiple of 8");
  MOE_CUDA_REQUIRE(size_t(tokens) * k * 2 <= 200 * 1024, "tokens * k too large for shared memory");
  MOE_CUDA_REQUIRE(reinterpret_cast<uintptr_t>(w) % 16 == 0, "w must be 16-byte aligned");
  // 5 to 8 tokens of INT8 weights and a plain input: tensor cores.
  if constexpr (kScaled && MODE == In::bf16) {
    if (tokens >= 5 && k % 64 == 0 && size_t(tokens) * (k / 8 + 1) * 16 <= 200 * 1024) {
      switch (tokens) {
        case 5: return launch_gemv_i8_mma<5>(w, row_scale, in.x, y, n_out, k, accumulate, gate_logits, gate_stride, stream);
        case 6: return launch_gemv_i8_mma<6>(w, row_scale, in.x, y, n_out, k, accumulate, gate_logits, gate_stride, stream);
        case 7: return launch_gemv_i8_mma<7>(w, row_scale, in.x, y, n_out, k, accumulate, gate_logits, gate_stride, stream);
        default: return launch_gemv_i8_mma<8>(w, row_scale, in.x, y, n_out, k, accumulate, gate_logits, gate_stride, stream);
      }
    }
  }
  switch (tokens) {
#define MOE_GEMV_CASE(T) \
  case T: return launch_gemv<W, T, MODE>(w, row_scale, in, y, n_out, k, accumulate, gate_logits, gate_stride, stream);
    MOE_GEMV_CASE(1) MOE_GEMV_CASE(2) MOE_GEMV_CASE(3) MOE_GEMV_CASE(4)
    MOE_GEMV_CASE(5) MOE_GEMV_CASE(6) MOE_GEMV_CASE(7) MOE_GEMV_CASE(8)
#undef MOE_GEMV_CASE
  }
  return make_error("dense_gemv: unreachable token count");
}

// The three inputs, for either weight type.
template <typename W>
Status gemv_bf16_in(const W* w, const float* row_scale, const __nv_bfloat16* x, float* y, int tokens, int n_out,
                    int k, bool accumulate, const float* gate_logits, int gate_stride, cudaStream_t stream) {
  MOE_CUDA_REQUIRE(x && reinterpret_cast<uintptr_t>(x) % 16 == 0, "x must be non-null and 16-byte aligned");
  GemvIn in;
  in.x = x;
  return gemv_dispatch<In::bf16>(w, row_scale, in, y, tokens, n_out, k, accumulate, gate_logits, gate_stride,
                                 stream);
}

template <typename W>
Status gemv_rmsnorm_in(const W* w, const float* row_scale, const float* x_f32, const __nv_bfloat16* norm_w,
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
  return gemv_dispatch<In::rmsnorm>(w, row_scale, in, y, tokens, n_out, k, accumulate, gate_logits, gate_stride,
                                    stream);
}

template <typename W>
Status gemv_silu_in(const W* w, const float* row_scale, const float* gate_up, int gate_up_stride, float* y,
                    int tokens, int n_out, int k, bool accumulate, const float* gate_logits, int gate_stride,
                    cudaStream_t stream) {
  MOE_CUDA_REQUIRE(gate_up && gate_up_stride >= 2 * k, "gate_up null or its stride below 2 k");
  GemvIn in;
  in.xf = gate_up;
  in.stride = gate_up_stride;
  return gemv_dispatch<In::silu>(w, row_scale, in, y, tokens, n_out, k, accumulate, gate_logits, gate_stride,
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

}  // namespace

Status dense_gemv_bf16(const __nv_bfloat16* w, const __nv_bfloat16* x, float* y, int tokens, int n_out, int k,
                       bool accumulate, const float* gate_logits, int gate_stride, cudaStream_t stream) {
  return gemv_bf16_in(w, nullptr, x, y, tokens, n_out, k, accumulate, gate_logits, gate_stride, stream);
}

Status dense_gemv_bf16_rmsnorm(const __nv_bfloat16* w, const float* x_f32, const __nv_bfloat16* norm_w, float eps,
                               __nv_bfloat16* xn_out, float* y, int tokens, int n_out, int k, bool accumulate,
                               const float* gate_logits, int gate_stride, cudaStream_t stream) {
  return gemv_rmsnorm_in(w, nullptr, x_f32, norm_w, eps, xn_out, y, tokens, n_out, k, accumulate, gate_logits,
                         gate_stride, stream);
}

Status dense_gemv_bf16_silu(const __nv_bfloat16* w, const float* gate_up, int gate_up_stride, float* y, int tokens,
                            int n_out, int k, bool accumulate, const float* gate_logits, int gate_stride,
                            cudaStream_t stream) {
  return gemv_silu_in(w, nullptr, gate_up, gate_up_stride, y, tokens, n_out, k, accumulate, gate_logits,
                      gate_stride, stream);
}

Status dense_gemv_i8(const int8_t* w, const float* row_scale, const __nv_bfloat16* x, float* y, int tokens,
                     int n_out, int k, bool accumulate, const float* gate_logits, int gate_stride,
                     cudaStream_t stream) {
  return gemv_bf16_in(w, row_scale, x, y, tokens, n_out, k, accumulate, gate_logits, gate_stride, stream);
}

Status dense_gemv_i8_rmsnorm(const int8_t* w, const float* row_scale, const float* x_f32,
                             const __nv_bfloat16* norm_w, float eps, __nv_bfloat16* xn_out, float* y, int tokens,
                             int n_out, int k, bool accumulate, const float* gate_logits, int gate_stride,
                             cudaStream_t stream) {
  return gemv_rmsnorm_in(w, row_scale, x_f32, norm_w, eps, xn_out, y, tokens, n_out, k, accumulate, gate_logits,
                         gate_stride, stream);
}

Status dense_gemv_i8_silu(const int8_t* w, const float* row_scale, const float* gate_up, int gate_up_stride,
                          float* y, int tokens, int n_out, int k, bool accumulate, const float* gate_logits,
                          int gate_stride, cudaStream_t stream) {
  return gemv_silu_in(w, row_scale, gate_up, gate_up_stride, y, tokens, n_out, k, accumulate, gate_logits,
                      gate_stride, stream);
}

Status quantize_rows_i8(const __nv_bfloat16* w, int n_out, int k, int8_t* q, float* row_scale,
                        cudaStream_t stream) {
  MOE_CUDA_REQUIRE(w && q && row_scale, "null pointer");
  MOE_CUDA_REQUIRE(n_out > 0 && k > 0, "shape must be positive");
  quantize_rows_kernel<<<n_out, kQuantThreads, 0, stream>>>(w, k, q, row_scale);
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
