#pragma once
// RMSNorm as Hugging Face computes it in float32:
//   y = w * (x / sqrt(mean(x^2) + eps))

#include <cstdint>

namespace moe::cpu {

// Normalises `rows` rows of `dim` values. x and y may be the same buffer.
// x: [rows, dim] (row stride x_stride floats), w: [dim],
// y: [rows, dim] (row stride y_stride floats).
void rmsnorm(const float* x, int64_t x_stride, const float* w, float* y, int64_t y_stride, int rows,
             int dim, float eps);

// Contiguous rows: x, y [rows, dim].
inline void rmsnorm(const float* x, const float* w, float* y, int rows, int dim, float eps) {
  rmsnorm(x, dim, w, y, dim, rows, dim, eps);
}

// Per-head norm (Qwen3-MoE q_norm/k_norm), in place: every head of every
// token normalised over head_dim with one weight shared by the heads.
// x: [tokens, heads, head_dim] (token stride token_stride floats; heads
// contiguous), w: [head_dim].
void rmsnorm_heads(float* x, int64_t token_stride, const float* w, int tokens, int heads,
                   int head_dim, float eps);

}  // namespace moe::cpu
