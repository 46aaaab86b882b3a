#include "kernels/cpu/rmsnorm.h"

#include <cmath>

namespace moe::cpu {

void rmsnorm(const float* x, int64_t x_stride, const float* w, float* y, int64_t y_stride, int rows,
             int dim, float eps) {
  for (int r = 0; r < rows; ++r) {
    const float* xr = x + r * x_stride;
    float* yr = y + r * y_stride;
    float ss = 0.0f;
    for (int i = 0; i < dim; ++i) ss += xr[i] * xr[i];
    const float inv = 1.0f / std::sqrt(ss / float(dim) + eps);
    for (int i = 0; i < dim; ++i) yr[i] = w[i] * (xr[i] * inv);
  }
}

void rmsnorm_heads(float* x, int64_t token_stride, const float* w, int tokens, int heads,
                   int head_dim, float eps) {
  for (int t = 0; t < tokens; ++t)
    rmsnorm(x + t * token_stride, head_dim, w, x + t * token_stride, head_dim, heads, head_dim,
            eps);
}

}  // namespace moe::cpu
