#include "kernels/cpu/matmul.h"

#include <algorithm>
#include <cstring>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define MOE_MATMUL_AVX2 1
#endif

namespace moe::cpu {

namespace {

// Every output is one dot product: 8 lanes accumulated with FMA over the
// multiple-of-8 part of the row in order, summed in a fixed order, then the
// tail added one by one. The tiles below only interleave several such dot
// products; they never change one's arithmetic.

inline float bf16_bits_to_f32(uint16_t b) {
  uint32_t u = uint32_t(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline float load_w(const float* w, int i) { return w[i]; }
inline float load_w(const uint16_t* w, int i) { return bf16_bits_to_f32(w[i]); }

#ifdef MOE_MATMUL_AVX2
inline __m256 load8(const float* w) { return _mm256_loadu_ps(w); }
inline __m256 load8(const uint16_t* w) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline float hsum(__m256 v) {
  const __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
  __m128 s = _mm_add_ps(lo, hi);                  // 4 lanes
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));         // 2 lanes
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 0x55));  // 1 lane
  return _mm_cvtss_f32(s);
}
#endif

// R weight rows x C tokens of outputs.
template <int R, int C, typename W>
inline void tile(const float* const* xs, const W* const* ws, int in, float out[R][C]) {
  int i = 0;
#ifdef MOE_MATMUL_AVX2
  // Fully unrolled so that the R*C accumulators stay in registers.
  __m256 acc[R][C];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) acc[r][c] = _mm256_setzero_ps();
  for (; i + 8 <= in; i += 8) {
    __m256 xv[C];
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) xv[c] = _mm256_loadu_ps(xs[c] + i);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m256 wv = load8(ws[r] + i);
#pragma GCC unroll 8
      for (int c = 0; c < C; ++c) acc[r][c] = _mm256_fmadd_ps(wv, xv[c], acc[r][c]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) out[r][c] = hsum(acc[r][c]);
#else
  float acc[R][C][8] = {};
  for (; i + 8 <= in; i += 8)
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c)
        for (int l = 0; l < 8; ++l) acc[r][c][l] += load_w(ws[r], i + l) * xs[c][i + l];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) {
      const float* a = acc[r][c];
      out[r][c] = ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]));
    }
#endif
  for (; i < in; ++i)
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) out[r][c] += load_w(ws[r], i) * xs[c][i];
}

constexpr int kRowsPerTask = 32;    // output rows per parallel task
constexpr int kTokensPerSlab = 64;  // tokens whose x rows stay in cache together

template <typename W>
void matmul_impl(const float* x, int64_t x_stride, const W* w, const float* bias, float* y,
                 int64_t y_stride, int tokens, int in, int out, ThreadPool* pool) {
  const int64_t tasks = (out + kRowsPerTask - 1) / kRowsPerTask;
  parallel_for(pool, tasks, [&](int64_t task) {
    const int o_begin = int(task) * kRowsPerTask, o_end = std::min(out, o_begin + kRowsPerTask);
    for (int t0 = 0; t0 < tokens; t0 += kTokensPerSlab) {
      const int t1 = std::min(tokens, t0 + kTokensPerSlab);
      int o = o_begin;
      for (; o + 4 <= o_end; o += 4) {
        const W* ws[4] = {w + int64_t(o) * in, w + int64_t(o + 1) * in, w + int64_t(o + 2) * in,
                          w + int64_t(o + 3) * in};
        int t = t0;
        for (; t + 2 <= t1; t += 2) {
          const float* xs[2] = {x + t * x_stride, x + (t + 1) * x_stride};
          float r[4][2];
          tile<4, 2>(xs, ws, in, r);
          for (int a = 0; a < 4; ++a)
            for (int b = 0; b < 2; ++b)
              y[(t + b) * y_stride + o + a] = r[a][b] + (bias ? bias[o + a] : 0.0f);
        }
        for (; t < t1; ++t) {
          const float* xs[1] = {x + t * x_stride};
          float r[4][1];
          tile<4, 1>(xs, ws, in, r);
          for (int a = 0; a < 4; ++a)
            y[t * y_stride + o + a] = r[a][0] + (bias ? bias[o + a] : 0.0f);
        }
      }
      for (; o < o_end; ++o) {
        const W* ws[1] = {w + int64_t(o) * in};
        for (int t = t0; t < t1; ++t) {
          const float* xs[1] = {x + t * x_stride};
          float r[1][1];
          tile<1, 1>(xs, ws, in, r);
          y[t * y_stride + o] = r[0][0] + (bias ? bias[o] : 0.0f);
        }
      }
    }
  });
}

}  // namespace

void matmul_f32(const float* x, int64_t x_stride, const float* w, const float* bias, float* y,
                int64_t y_stride, int tokens, int in, int out, ThreadPool* pool) {
  matmul_impl(x, x_stride, w, bias, y, y_stride, tokens, in, out, pool);
}

void matmul_bf16(const float* x, int64_t x_stride, const uint16_t* w, const float* bias, float* y,
                 int64_t y_stride, int tokens, int in, int out, ThreadPool* pool) {
  matmul_impl(x, x_stride, w, bias, y, y_stride, tokens, in, out, pool);
}

float dot_f32(const float* a, const float* b, int n) {
  const float* xs[1] = {a};
  const float* ws[1] = {b};
  float r[1][1];
  tile<1, 1>(xs, ws, n, r);
  return r[0][0];
}

void axpy_f32(float a, const float* x, float* y, int n) {
  int i = 0;
#ifdef MOE_MATMUL_AVX2
  const __m256 av = _mm256_set1_ps(a);
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(y + i, _mm256_fmadd_ps(av, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
#endif
  for (; i < n; ++i) y[i] += a * x[i];
}

}  // namespace moe::cpu
