#include "model/int4.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "model/safetensors.h"  // f32 <-> f16

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define MOE_Q4_AVX2 1
#endif
// AVX-512 is chosen at run time, where the CPU has it (the build targets
// AVX2 machines).
#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define MOE_Q4_AVX512 1
#endif

namespace moe {

namespace {

size_t align_up(size_t n, size_t a) { return (n + a - 1) / a * a; }

// Lays out one matrix at `offset`; returns the offset just past its params.
size_t place_matrix(Q4MatrixLayout* m, int rows, int cols, int group, size_t offset) {
  m->rows = rows;
  m->cols = cols;
  m->group = q4_effective_group(cols, group);
  m->codes_offset = align_up(offset, kQ4Align);
  m->params_offset = align_up(m->codes_offset + m->codes_bytes(), kQ4Align);
  return m->params_offset + m->params_bytes();
}

// The smallest half that is >= v (v > 0), so that the scale's grid covers the
// group's range after rounding to half.
float half_at_least(float v) {
  uint16_t h = f32_to_f16(std::min(v, 65504.0f));
  if (f16_to_f32(h) < v && h < 0x7bff) ++h;  // positive halves order like their bits
  return f16_to_f32(h);
}

void store_params(uint8_t* p, float scale, float bias) {
  const uint16_t s = f32_to_f16(scale), b = f32_to_f16(bias);
  std::memcpy(p, &s, 2);
  std::memcpy(p + 2, &b, 2);
}

void load_params(const uint8_t* p, float* scale, float* bias) {
  uint16_t s, b;
  std::memcpy(&s, p, 2);
  std::memcpy(&b, p + 2, 2);
  *scale = f16_to_f32(s);
  *bias = f16_to_f32(b);
}

// Quantises one group of `n` weights (n even) into n/2 code bytes and its params.
void quantize_group(const float* w, int n, uint8_t* codes, uint8_t* params) {
  float lo = w[0], hi = w[0];
  for (int j = 1; j < n; ++j) {
    lo = std::min(lo, w[j]);
    hi = std::max(hi, w[j]);
  }
  if (lo == hi) {
    // A constant group: scale 0 and bias = the value, exact for any bf16 value
    // in half's range.
    store_params(params, 0.0f, lo);
    std::memset(codes, 0, size_t(n) / 2);
    return;
  }
  // An integer zero point in 0..15 puts 0 on the grid, so the range must hold 0.
  lo = std::min(lo, 0.0f);
  hi = std::max(hi, 0.0f);
  const float scale = half_at_least((hi - lo) / 15.0f);
  const float zp = std::clamp(std::round(-lo / scale), 0.0f, 15.0f);
  const float bias = f16_to_f32(f32_to_f16(-zp * scale));
  store_params(params, scale, bias);
  // Codes against the stored (rounded) params, so dequantisation is nearest.
  auto code = [&](float v) {
    return uint8_t(std::clamp(std::round((v - bias) / scale), 0.0f, 15.0f));
  };
  for (int j = 0; j < n / 2; ++j) codes[j] = uint8_t(code(w[2 * j]) | (code(w[2 * j + 1]) << 4));
}

// Splits a row's codes into one float per input: q[2j] = low nibble of byte j.
void unpack_codes(const uint8_t* codes, int cols, float* q) {
  for (int j = 0; j < cols / 2; ++j) {
    q[2 * j] = float(codes[j] & 0x0f);
    q[2 * j + 1] = float(codes[j] >> 4);
  }
}

// Dot product with eight independent partial sums, so the compiler can keep
// them in one vector register without reassociating a single sum.
float dot(const float* a, const float* b, int n) {
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int j = 0;
  for (; j + 8 <= n; j += 8)
    for (int k = 0; k < 8; ++k) acc[k] += a[j + k] * b[j + k];
  float tail = 0.0f;
  for (; j < n; ++j) tail += a[j] * b[j];
  return ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7])) + tail;
}

}  // namespace

int q4_effective_group(int k, int group) {
  int g = 2;
  while (g * 2 <= group) g *= 2;  // the largest power of two <= group
  while (g > 2 && k % g != 0) g /= 2;
  return g;
}

ExpertLayout expert_layout(int hidden, int inter, int group) {
  ExpertLayout e;
  e.hidden = hidden;
  e.inter = inter;
  e.group = group;
  size_t end = place_matrix(&e.gate, inter, hidden, group, 0);
  end = place_matrix(&e.up, inter, hidden, group, end);
  end = place_matrix(&e.down, hidden, inter, group, end);
  e.blob_bytes = align_up(end, kQ4Align);
  return e;
}

Q4MatrixLayout q4_matrix_layout(int rows, int cols, int group) {
  Q4MatrixLayout m;
  place_matrix(&m, rows, cols, group, 0);
  return m;
}

size_t q4_matrix_bytes(const Q4MatrixLayout& m) { return m.params_offset + m.params_bytes(); }

Q4MatrixLayout q4_row_slice(const Q4MatrixLayout& m, int r0, int n) {
  Q4MatrixLayout s = m;
  s.rows = n;
  s.codes_offset += size_t(r0) * size_t(m.cols / 2);
  s.params_offset += size_t(r0) * size_t(m.cols / m.group) * 4;
  return s;
}

void q4_quantize_matrix(const float* w, const Q4MatrixLayout& m, uint8_t* blob) {
  const int groups = m.cols / m.group;
  for (int r = 0; r < m.rows; ++r)
    for (int g = 0; g < groups; ++g)
      quantize_group(
          w + size_t(r) * size_t(m.cols) + size_t(g) * size_t(m.group), m.group,
          blob + m.codes_offset + size_t(r) * size_t(m.cols / 2) + size_t(g) * size_t(m.group / 2),
          blob + m.params_offset + (size_t(r) * size_t(groups) + size_t(g)) * 4);
}

void q4_store_group(const Q4MatrixLayout& m, uint8_t* blob, int row, int g, const uint8_t* codes,
                    uint16_t scale_bits, uint16_t bias_bits) {
  const int groups = m.cols / m.group;
  uint8_t* c = blob + m.codes_offset + size_t(row) * size_t(m.cols / 2) + size_t(g) * size_t(m.group / 2);
  for (int i = 0; i < m.group; i += 2) c[i / 2] = uint8_t((codes[i] & 0xF) | (codes[i + 1] << 4));
  uint8_t* p = blob + m.params_offset + (size_t(row) * size_t(groups) + size_t(g)) * 4;
  std::memcpy(p, &scale_bits, 2);
  std::memcpy(p + 2, &bias_bits, 2);
}

void q4_dequantize_row(const uint8_t* blob, const Q4MatrixLayout& m, int row, float* out) {
  const int groups = m.cols / m.group;
  const uint8_t* codes = blob + m.codes_offset + size_t(row) * size_t(m.cols / 2);
  const uint8_t* params = blob + m.params_offset + size_t(row) * size_t(groups) * 4;
  unpack_codes(codes, m.cols, out);
  for (int g = 0; g < groups; ++g) {
    float scale, bias;
    load_params(params + size_t(g) * 4, &scale, &bias);
    float* o = out + size_t(g) * size_t(m.group);
    for (int j = 0; j < m.group; ++j) o[j] = o[j] * scale + bias;
  }
}

namespace {

// Portable path: works for any group size.
void matvec_rows_portable(int r0, int r1, const uint8_t* blob, const Q4MatrixLayout& m, const float* x,
                          const float* x_sums, float* y, int cols) {
  const int groups = cols / m.group;
  std::vector<float> q(static_cast<size_t>(m.cols));  // [cols]: one row's codes as floats
  for (int r = r0; r < r1; ++r) {
    unpack_codes(blob + m.codes_offset + size_t(r) * size_t(m.cols / 2), m.cols, q.data());
    const uint8_t* params = blob + m.params_offset + size_t(r) * size_t(m.cols / m.group) * 4;
    float acc = 0.0f;
    for (int g = 0; g < groups; ++g) {
      float scale, bias;
      load_params(params + size_t(g) * 4, &scale, &bias);
      const size_t at = size_t(g) * size_t(m.group);
      acc += scale * dot(q.data() + at, x + at, m.group) + bias * x_sums[g];
    }
    y[r] = acc;
  }
}

// Row r's codes and its (scale, bias) half pairs.
const uint8_t* row_codes(const uint8_t* blob, const Q4MatrixLayout& m, int r) {
  return blob + m.codes_offset + size_t(r) * size_t(m.cols / 2);
}
const uint16_t* row_params(const uint8_t* blob, const Q4MatrixLayout& m, int r) {
  return reinterpret_cast<const uint16_t*>(blob + m.params_offset + size_t(r) * size_t(m.cols / m.group) * 4);
}

#ifdef MOE_Q4_AVX2
// The 32 codes of 16 bytes as bytes in input order: inputs 0..15 in *q0,
// 16..31 in *q1.
inline void unpack32(const uint8_t* c, __m128i* q0, __m128i* q1) {
  const __m128i low_nibble = _mm_set1_epi8(0x0f);
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(c));
  const __m128i lo = _mm_and_si128(b, low_nibble);
  const __m128i hi = _mm_and_si128(_mm_srli_epi16(b, 4), low_nibble);
  *q0 = _mm_unpacklo_epi8(lo, hi);
  *q1 = _mm_unpackhi_epi8(lo, hi);
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// AVX2 path for groups that are a multiple of 32 inputs (16 code bytes): the
// nibbles are split and re-interleaved in registers, widened to floats and
// multiplied with x; each group's partial sums are scaled in vector form so
// only one horizontal sum is paid per row.
void matvec_rows_avx2(int r0, int r1, const uint8_t* blob, const Q4MatrixLayout& m, const float* x,
                      const float* x_sums, float* y, int cols) {
  const int groups = cols / m.group;
  const int chunks = m.group / 32;  // 32 inputs per chunk
  for (int r = r0; r < r1; ++r) {
    const uint8_t* codes = row_codes(blob, m, r);
    const uint16_t* params = row_params(blob, m, r);
    __m256 acc = _mm256_setzero_ps();
    float bias_acc = 0.0f;
    for (int g = 0; g < groups; ++g) {
      __m256 p0 = _mm256_setzero_ps(), p1 = _mm256_setzero_ps();
      const uint8_t* c = codes + size_t(g) * size_t(m.group / 2);
      const float* xg = x + size_t(g) * size_t(m.group);
      for (int i = 0; i < chunks; ++i) {
        __m128i q0, q1;
        unpack32(c + 16 * i, &q0, &q1);
        const float* xc = xg + 32 * i;
        p0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(q0)), _mm256_loadu_ps(xc), p0);
        p1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(q0, 8))),
                             _mm256_loadu_ps(xc + 8), p1);
        p0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(q1)), _mm256_loadu_ps(xc + 16),
                             p0);
        p1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(q1, 8))),
                             _mm256_loadu_ps(xc + 24), p1);
      }
      const float scale = _cvtsh_ss(params[2 * g]);
      const float bias = _cvtsh_ss(params[2 * g + 1]);
      acc = _mm256_fmadd_ps(_mm256_set1_ps(scale), _mm256_add_ps(p0, p1), acc);
      bias_acc += bias * x_sums[g];
    }
    y[r] = hsum(acc) + bias_acc;
  }
}
#endif

#ifdef MOE_Q4_AVX512
#define MOE_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,fma,f16c")))
// GCC 12's AVX-512 headers start some conversions from an undefined vector,
// which -Wmaybe-uninitialized reports inside them (clang knows no such warning).
#pragma GCC diagnostic push
#ifndef __clang__
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

// The AVX-512 form of matvec_rows_avx2: a chunk's 16 code bytes widen to 16
// lanes once; their low nibbles meet the chunk's 16 even inputs and their
// high nibbles its 16 odd ones, from x split that way once per call. A chunk
// of 32 weights costs one widening, an and, a shift, two conversions and two
// multiply-adds. A row's (scale, bias) halves become floats 8 groups at a
// time; each group's scale then multiplies from memory (groups alternate
// between two accumulators so those multiply-adds do not queue), and the
// bias term is one vector dot with (0, sum of x) pairs.
MOE_AVX512 void matvec_rows_avx512(int r0, int r1, const uint8_t* blob, const Q4MatrixLayout& m, const float* x,
                                   const float* x_sums, float* y, int cols) {
  const int groups = cols / m.group;
  const int chunks = m.group / 32;
  const int pairs = 2 * groups;                // (scale, bias) halves of a row's groups
  const int padded = (pairs + 15) / 16 * 16;  // whole vectors of them
  thread_local std::vector<float> split, sb, gs;
  split.resize(size_t(cols));
  sb.resize(size_t(padded));
  gs.assign(size_t(padded), 0.0f);
  for (int g = 0; g < groups; ++g) gs[size_t(2 * g + 1)] = x_sums[g];
  const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i odd = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
  for (int c = 0; c < cols; c += 32) {
    const __m512 a = _mm512_loadu_ps(x + c), b = _mm512_loadu_ps(x + c + 16);
    _mm512_storeu_ps(split.data() + c, _mm512_permutex2var_ps(a, even, b));
    _mm512_storeu_ps(split.data() + c + 16, _mm512_permutex2var_ps(a, odd, b));
  }
  const __m512i low = _mm512_set1_epi32(0x0f);
  for (int r = r0; r < r1; ++r) {
    const uint8_t* codes = row_codes(blob, m, r);
    const uint16_t* params = row_params(blob, m, r);
    for (int i = 0; i < pairs; i += 16) {
      const __mmask16 k = pairs - i >= 16 ? __mmask16(0xffff) : __mmask16((1u << (pairs - i)) - 1);
      _mm512_storeu_ps(sb.data() + i, _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(k, params + i)));
    }
    __m512 acc[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
    for (int g = 0; g < groups; ++g) {
      const uint8_t* c = codes + size_t(g) * size_t(m.group / 2);
      const float* xs = split.data() + size_t(g) * size_t(m.group);
      __m512 p = _mm512_setzero_ps();
      for (int i = 0; i < chunks; ++i) {
        const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c + 16 * i)));
        p = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(v, low)), _mm512_loadu_ps(xs + 32 * i), p);
        p = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4)), _mm512_loadu_ps(xs + 32 * i + 16), p);
      }
      acc[g & 1] = _mm512_fmadd_ps(_mm512_set1_ps(sb[size_t(2 * g)]), p, acc[g & 1]);
    }
    __m512 bias = _mm512_setzero_ps();
    for (int i = 0; i < padded; i += 16)
      bias = _mm512_fmadd_ps(_mm512_loadu_ps(sb.data() + i), _mm512_loadu_ps(gs.data() + i), bias);
    y[r] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), bias));
  }
}

bool have_avx512() {
  // Every CPU with AVX-512 has F16C (and clang's __builtin_cpu_supports does
  // not know the name), so these three say enough.
  static const bool yes = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512vl");
  return yes;
}
#pragma GCC diagnostic pop
#endif

#ifdef MOE_Q4_AVX2
// q4_matvec_rows_q8 over runs of 64 inputs with x in q_split order: the low
// nibbles of 32 code bytes meet the 32 even inputs, the high ones the odd,
// in two maddubs, with no unpacking; lanes 0-3 of the sum hold the run's
// first block of 32, lanes 4-7 its second. The bias term sum_g b_g sum(x_g)
// is one multiply-add per group against interleaved (scale, bias) pairs.
void matvec_rows_q8_split(const uint8_t* blob, const Q4MatrixLayout& m, const Q8Input& xq, int row_begin,
                          int row_end, float* y, int cols) {
  const int runs = cols / 64;
  const int groups = cols / m.group;
  const int runs_per_group = m.group / 64;  // 0 when the group is 32
  // Per run: the two blocks' x scales, four lanes each. Per group: its x sum
  // at the bias's place of (scale, bias), zero at the scale's.
  std::vector<float> xsc(size_t(runs) * 8), gsum(size_t(groups + 3) / 4 * 8, 0.f);
  for (int r = 0; r < runs; ++r)
    for (int l = 0; l < 8; ++l) xsc[size_t(r) * 8 + l] = xq.scale[size_t(2 * r + l / 4)];
  for (int b = 0; b < cols / 32; ++b) gsum[size_t(b * 32 / m.group) * 2 + 1] += xq.sum[size_t(b)];
  const __m256i low = _mm256_set1_epi8(0x0f);
  const __m256i ones = _mm256_set1_epi16(1);
  const int8_t* xs = xq.q_split.data();
  for (int r = row_begin; r < row_end; ++r) {
    const uint8_t* codes = row_codes(blob, m, r);
    const uint16_t* params = row_params(blob, m, r);
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    for (int run = 0; run < runs; ++run) {
      const __m256i cv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + size_t(run) * 32));
      const __m256i lo = _mm256_and_si256(cv, low);
      const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(cv, 4), low);
      const __m256i xe = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xs + size_t(run) * 64));
      const __m256i xo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xs + size_t(run) * 64 + 32));
      const __m256i s16 = _mm256_add_epi16(_mm256_maddubs_epi16(lo, xe), _mm256_maddubs_epi16(hi, xo));
      const __m256 f = _mm256_cvtepi32_ps(_mm256_madd_epi16(s16, ones));
      __m256 sv;
      if (runs_per_group == 0) {  // group 32: the run's two blocks have groups of their own
        sv = _mm256_set_m128(_mm_set1_ps(_cvtsh_ss(params[4 * run + 2])), _mm_set1_ps(_cvtsh_ss(params[4 * run])));
      } else {
        sv = _mm256_set1_ps(_cvtsh_ss(params[2 * (run / runs_per_group)]));
      }
      const __m256 d = _mm256_mul_ps(sv, _mm256_loadu_ps(xsc.data() + size_t(run) * 8));
      if (run & 1) acc1 = _mm256_fmadd_ps(f, d, acc1);
      else acc0 = _mm256_fmadd_ps(f, d, acc0);
    }
    // Bias: four groups' (scale, bias) halves at a time against (0, sum).
    __m256 bacc = _mm256_setzero_ps();
    int g = 0;
    for (; g + 4 <= groups; g += 4) {
      const __m256 p = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(params + 2 * g)));
      bacc = _mm256_fmadd_ps(p, _mm256_loadu_ps(gsum.data() + size_t(g) * 2), bacc);
    }
    float bias = 0.f;
    for (; g < groups; ++g) bias += _cvtsh_ss(params[2 * g + 1]) * gsum[size_t(g) * 2 + 1];
    y[r] = hsum(_mm256_add_ps(acc0, acc1)) + hsum(bacc) + bias;
  }
}
#endif

}  // namespace

void q4_matvec(const uint8_t* blob, const Q4MatrixLayout& m, const float* x, float* y) {
  q4_matvec_rows(blob, m, x, 0, m.rows, y);
}

namespace {
// The inputs q4_matvec_rows sums over: whole groups of the first col_end.
int summed_cols(const Q4MatrixLayout& m, int col_end) {
  return col_end > 0 && col_end < m.cols ? col_end / m.group * m.group : m.cols;
}
}  // namespace

void q4_group_sums(const Q4MatrixLayout& m, const float* x, int col_end, float* sums) {
  const int groups = summed_cols(m, col_end) / m.group;
  for (int g = 0; g < groups; ++g) {
    float s = 0.0f;
    for (int j = 0; j < m.group; ++j) s += x[size_t(g) * size_t(m.group) + size_t(j)];
    sums[g] = s;
  }
}

void q4_matvec_rows_summed(const uint8_t* blob, const Q4MatrixLayout& m, const float* x, const float* x_sums,
                           int row_begin, int row_end, float* y, int col_end) {
  const int cols = summed_cols(m, col_end);
#ifdef MOE_Q4_AVX512
  if (m.group % 32 == 0 && have_avx512()) return matvec_rows_avx512(row_begin, row_end, blob, m, x, x_sums, y, cols);
#endif
#ifdef MOE_Q4_AVX2
  if (m.group % 32 == 0) return matvec_rows_avx2(row_begin, row_end, blob, m, x, x_sums, y, cols);
#endif
  matvec_rows_portable(row_begin, row_end, blob, m, x, x_sums, y, cols);
}

void q4_matvec_rows(const uint8_t* blob, const Q4MatrixLayout& m, const float* x, int row_begin, int row_end,
                    float* y, int col_end) {
  // Per group, sum_j (q_j s + b) x_j = s (q . x) + b sum(x): the sums of x are
  // shared by every row, so each weight costs one multiply-add.
  std::vector<float> x_sums(static_cast<size_t>(m.cols / m.group));
  q4_group_sums(m, x, col_end, x_sums.data());
  q4_matvec_rows_summed(blob, m, x, x_sums.data(), row_begin, row_end, y, col_end);
}

int q8_block(const Q4MatrixLayout& m) { return std::min(32, m.group); }

void q8_quantize(const float* x, int cols, int block, Q8Input* out) {
  const int blocks = cols / block;
  out->block = block;
  out->q.resize(size_t(cols));
  out->scale.resize(size_t(blocks));
  out->sum.resize(size_t(blocks));
  for (int g = 0; g < blocks; ++g) {
    const float* xg = x + size_t(g) * block;
    float mx = 0.f, sum = 0.f;
    for (int j = 0; j < block; ++j) {
      mx = std::max(mx, std::fabs(xg[j]));
      sum += xg[j];
    }
    const float inv = mx > 0.f ? 127.f / mx : 0.f;
    for (int j = 0; j < block; ++j) out->q[size_t(g) * block + j] = int8_t(std::lrint(xg[j] * inv));
    out->scale[size_t(g)] = mx / 127.f;
    out->sum[size_t(g)] = sum;
  }
  out->q_split.clear();
  if (block == 32 && cols % 64 == 0) {
    out->q_split.resize(size_t(cols));
    for (int c = 0; c < cols; c += 64)
      for (int i = 0; i < 32; ++i) {
        out->q_split[size_t(c + i)] = out->q[size_t(c + 2 * i)];
        out->q_split[size_t(c + 32 + i)] = out->q[size_t(c + 2 * i + 1)];
      }
  }
}

void q4_matvec_rows_q8(const uint8_t* blob, const Q4MatrixLayout& m, const Q8Input& xq, int row_begin, int row_end,
                       float* y, int col_end) {
  const int cols = col_end > 0 && col_end < m.cols ? col_end / m.group * m.group : m.cols;
  const int groups = cols / m.group;
  const int bpg = m.group / xq.block;  // blocks per group
#ifdef MOE_Q4_AVX2
  if (!xq.q_split.empty() && cols % 64 == 0 && (m.group == 32 || m.group % 64 == 0))
    return matvec_rows_q8_split(blob, m, xq, row_begin, row_end, y, cols);
  if (m.group % 32 == 0) {
    const __m256i ones = _mm256_set1_epi16(1);
    for (int r = row_begin; r < row_end; ++r) {
      const uint8_t* codes = row_codes(blob, m, r);
      const uint16_t* params = row_params(blob, m, r);
      __m256 acc = _mm256_setzero_ps();
      float bias_acc = 0.f;
      for (int g = 0; g < groups; ++g) {
        const float scale = _cvtsh_ss(params[2 * g]);
        const float bias = _cvtsh_ss(params[2 * g + 1]);
        const uint8_t* c = codes + size_t(g) * size_t(m.group / 2);
        for (int b = 0; b < bpg; ++b) {
          const int blk = g * bpg + b;
          __m128i q0, q1;
          unpack32(c + 16 * b, &q0, &q1);
          const __m256i q = _mm256_set_m128i(q1, q0);  // the block's 32 codes in input order
          const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq.q.data() + size_t(blk) * 32));
          const __m256i isum = _mm256_madd_epi16(_mm256_maddubs_epi16(q, xv), ones);
          acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_set1_ps(scale * xq.scale[size_t(blk)]), acc);
          bias_acc += bias * xq.sum[size_t(blk)];
        }
      }
      y[r] = hsum(acc) + bias_acc;
    }
    return;
  }
#endif
  for (int r = row_begin; r < row_end; ++r) {
    const uint8_t* codes = blob + m.codes_offset + size_t(r) * size_t(m.cols / 2);
    const uint8_t* params = blob + m.params_offset + size_t(r) * size_t(m.cols / m.group) * 4;
    float acc = 0.f;
    for (int g = 0; g < groups; ++g) {
      float scale, bias;
      load_params(params + size_t(g) * 4, &scale, &bias);
      for (int b = 0; b < bpg; ++b) {
        const int blk = g * bpg + b;
        int32_t isum = 0;
        for (int j = 0; j < xq.block; j += 2) {
          const size_t at = size_t(blk) * xq.block + j;
          const uint8_t byte = codes[at / 2];
          isum += int32_t(byte & 15) * xq.q[at] + int32_t(byte >> 4) * xq.q[at + 1];
        }
        acc += scale * xq.scale[size_t(blk)] * float(isum) + bias * xq.sum[size_t(blk)];
      }
    }
    y[r] = acc;
  }
}

}  // namespace moe
