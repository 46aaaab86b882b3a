#pragma once
// Linear layers: y[t, o] = sum_i x[t, i] * W[o, i] (+ bias[o]), W in PyTorch
// `Linear` orientation [out, in]. Threads split the output rows. Every output
// is computed with the same arithmetic whatever the number of tokens or the
// position of its row, so a token's result does not depend on what else is in
// the batch (bitwise).

#include <cstdint>

#include "kernels/cpu/thread_pool.h"

namespace moe::cpu {

// x: [tokens, in] (row stride x_stride), w: [out, in] f32, bias: [out] or null,
// y: [tokens, out] (row stride y_stride). y must not alias x.
void matmul_f32(const float* x, int64_t x_stride, const float* w, const float* bias, float* y,
                int64_t y_stride, int tokens, int in, int out, ThreadPool* pool);

// The same with W stored as bf16 (raw uint16 bits), converted on the fly.
void matmul_bf16(const float* x, int64_t x_stride, const uint16_t* w, const float* bias, float* y,
                 int64_t y_stride, int tokens, int in, int out, ThreadPool* pool);

// Contiguous forms: x [tokens, in], y [tokens, out].
inline void matmul_f32(const float* x, const float* w, const float* bias, float* y, int tokens,
                       int in, int out, ThreadPool* pool) {
  matmul_f32(x, in, w, bias, y, out, tokens, in, out, pool);
}
inline void matmul_bf16(const float* x, const uint16_t* w, const float* bias, float* y, int tokens,
                        int in, int out, ThreadPool* pool) {
  matmul_bf16(x, in, w, bias, y, out, tokens, in, out, pool);
}

// The dot product every matmul output uses: a[n] . b[n] (b as f32).
float dot_f32(const float* a, const float* b, int n);

// y[n] += a * x[n] (x and y must not overlap).
void axpy_f32(float a, const float* x, float* y, int n);

}  // namespace moe::cpu
