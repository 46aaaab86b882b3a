#include "kernels/cpu/rope.h"

#include <algorithm>
#include <cmath>

namespace moe::cpu {

std::vector<float> rope_inv_freq_default(float theta, int rot_dim) {
  std::vector<float> f(rot_dim / 2);
  for (int i = 0; i < rot_dim / 2; ++i) {
    // float32 exponent as the reference computes it, then the power in double.
    const float e = float(2 * i) / float(rot_dim);
    f[i] = float(1.0 / std::pow(double(theta), double(e)));
  }
  return f;
}

static double yarn_mscale(double scale, double m) {
  return scale <= 1.0 ? 1.0 : 0.1 * m * std::log(scale) + 1.0;
}

std::vector<float> rope_inv_freq_yarn(float theta, int rot_dim, float factor,
                                      int original_max_position, float beta_fast, float beta_slow,
                                      float mscale, float mscale_all_dim, float* attention_factor) {
  const double base = theta, dim = rot_dim;
  if (attention_factor) {
    if (mscale != 0.0f && mscale_all_dim != 0.0f)
      *attention_factor = float(yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim));
    else
      *attention_factor = float(yarn_mscale(factor, 1.0));
  }
  auto correction_dim = [&](double rotations) {
    return dim * std::log(double(original_max_position) / (rotations * 2.0 * M_PI)) /
           (2.0 * std::log(base));
  };
  double low = std::max(std::floor(correction_dim(beta_fast)), 0.0);
  double high = std::min(std::ceil(correction_dim(beta_slow)), dim - 1);
  if (low == high) high += 0.001;
  std::vector<float> f(rot_dim / 2);
  for (int i = 0; i < rot_dim / 2; ++i) {
    const double pos_freq = std::pow(base, double(2 * i) / dim);
    const double extrapolation = 1.0 / pos_freq, interpolation = 1.0 / (factor * pos_freq);
    const double ramp = std::clamp((double(i) - low) / (high - low), 0.0, 1.0);
    const double extrapolation_factor = 1.0 - ramp;
    f[i] =
        float(interpolation * (1.0 - extrapolation_factor) + extrapolation * extrapolation_factor);
  }
  return f;
}

template <bool kInterleaved>
static void rope_apply(float* x, int64_t token_stride, int64_t head_stride,
                       const int32_t* positions, int tokens, int heads, int rot_dim,
                       const float* inv_freq, float attention_factor) {
  const int half = rot_dim / 2;
  std::vector<float> c(half), s(half);
  for (int t = 0; t < tokens; ++t) {
    for (int i = 0; i < half; ++i) {
      // The angle rounded to float32 as the reference forms it (pos * inv_freq).
      const float a = float(positions[t]) * inv_freq[i];
      c[i] = float(std::cos(double(a))) * attention_factor;
      s[i] = float(std::sin(double(a))) * attention_factor;
    }
    for (int h = 0; h < heads; ++h) {
      float* v = x + t * token_stride + h * head_stride;
      for (int i = 0; i < half; ++i) {
        float* a = kInterleaved ? &v[2 * i] : &v[i];
        float* b = kInterleaved ? &v[2 * i + 1] : &v[i + half];
        const float x0 = *a, x1 = *b;
        *a = x0 * c[i] - x1 * s[i];
        *b = x1 * c[i] + x0 * s[i];
      }
    }
  }
}

void rope_neox(float* x, int64_t token_stride, int64_t head_stride, const int32_t* positions,
               int tokens, int heads, int rot_dim, const float* inv_freq, float attention_factor) {
  rope_apply<false>(x, token_stride, head_stride, positions, tokens, heads, rot_dim, inv_freq,
                    attention_factor);
}

void rope_interleaved(float* x, int64_t token_stride, int64_t head_stride, const int32_t* positions,
                      int tokens, int heads, int rot_dim, const float* inv_freq,
                      float attention_factor) {
  rope_apply<true>(x, token_stride, head_stride, positions, tokens, heads, rot_dim, inv_freq,
                   attention_factor);
}

}  // namespace moe::cpu
