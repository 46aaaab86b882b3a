#pragma once
// The KV cache's storage types (docs/kv-cache.md) and the host's encoding of
// one row: the CPU engine's store and the reference the CUDA store is tested
// against. A coded row is `n` one-byte codes and one f32 scale.

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <limits>

namespace moe {

// bf16: the CUDA engine's 16-bit rows (the CPU engine keeps f32 then).
enum class KvDtype { bf16, int8, fp8 };

inline bool kv_coded(KvDtype d) { return d != KvDtype::bf16; }

// The largest code magnitude: the scale maps a row's max |x| onto it.
inline float kv_code_max(KvDtype d) { return d == KvDtype::fp8 ? 448.0f : 127.0f; }

// e4m3 (bias 7, no infinities, 0x7f/0xff NaN, largest 448): the nearest
// code to x, ties to even, finite values past 448 saturated.
inline uint8_t e4m3_encode(float x) {
  const uint8_t sign = std::signbit(x) ? 0x80 : 0;
  const float a = std::fabs(x);
  if (std::isnan(a)) return 0x7f;
  if (a >= 448.0f) return sign | 0x7e;
  int e = 0;
  std::frexp(a, &e);  // a = m 2^e, m in [0.5, 1): the binade is 2^(e-1)
  const int binade = std::max(e - 1, -6);  // below 2^-6: subnormals, steps of 2^-9
  const float quantum = std::ldexp(1.0f, binade - 3);
  const float r = std::nearbyint(a / quantum) * quantum;  // the default rounding: ties to even
  if (r == 0.0f) return sign;
  std::frexp(r, &e);
  if (e - 1 < -6) return sign | uint8_t(std::lround(r / std::ldexp(1.0f, -9)));
  const int mant = int(std::lround((r / std::ldexp(1.0f, e - 1) - 1.0f) * 8.0f));
  return sign | uint8_t((e - 1 + 7) << 3) | uint8_t(mant);
}

inline float e4m3_decode(uint8_t c) {
  const float s = (c & 0x80) ? -1.0f : 1.0f;
  const int e = (c >> 3) & 15, m = c & 7;
  if (e == 15 && m == 7) return NAN;
  if (e == 0) return s * std::ldexp(float(m), -9);
  return s * std::ldexp(1.0f + float(m) / 8.0f, e - 7);
}

// code → value before the scale, for all 256 codes.
inline const std::array<float, 256>& kv_code_table(KvDtype d) {
  static const std::array<float, 256> i8 = [] {
    std::array<float, 256> t{};
    for (int c = 0; c < 256; ++c) t[size_t(c)] = float(int8_t(uint8_t(c)));
    return t;
  }();
  static const std::array<float, 256> f8 = [] {
    std::array<float, 256> t{};
    for (int c = 0; c < 256; ++c) t[size_t(c)] = e4m3_decode(uint8_t(c));
    return t;
  }();
  return d == KvDtype::fp8 ? f8 : i8;
}

// Codes and scale of one row of n values. inv = code_max / max|x| in f32,
// the code of x that of x * inv, the scale max|x| / code_max (0 for a row of
// zeros): the CUDA store computes the same products.
inline float kv_encode_row(KvDtype d, const float* x, int n, uint8_t* codes) {
  float amax = 0.0f;
  for (int i = 0; i < n; ++i) amax = std::max(amax, std::fabs(x[i]));
  const float cmax = kv_code_max(d);
  // A row too small for its inverse to stay finite is stored as zeros.
  const float inv = amax > cmax / std::numeric_limits<float>::max() ? cmax / amax : 0.0f;
  if (inv == 0.0f) amax = 0.0f;
  for (int i = 0; i < n; ++i) {
    const float y = x[i] * inv;
    if (d == KvDtype::fp8) {
      codes[i] = e4m3_encode(y);
    } else {
      const float r = std::clamp(std::nearbyint(y), -127.0f, 127.0f);
      codes[i] = uint8_t(int8_t(r));
    }
  }
  return amax / cmax;
}

}  // namespace moe
