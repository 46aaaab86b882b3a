#pragma once
// bf16 dense layers, y = x W^T with W in Linear orientation [out, in]
// (CPU twin: matmul_bf16 in kernels/cpu/matmul.h).
//  - dense_gemv_bf16: decode batches (<= 8 tokens), a warp per two output
//    rows streaming W once for all tokens.
//  - dense_gemv_i8: the same with INT8 weights and a scale per row;
//    quantize_rows_i8 / dequantize_rows_i8 convert (dequantised weights feed
//    the prefill path).
//  - dense_gemv_q4: the same with INT4 weights, one matrix in the layout of
//    docs/int4-experts.md (model/int4.h: q4_matrix_layout); dequantize_q4
//    turns one back into bf16 for the prefill path.
//  - CublasLtMatmul: everything larger (prefill), through cuBLASLt.

#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <map>
#include <tuple>

#include "model/int4.h"
#include "model/result.h"

namespace moe::cuda {

constexpr int kGemvMaxTokens = 8;

// y[t, n] (+)= g_t * (W[n, :] . x[t, :]) with g_t = sigmoid(gate_logits[t *
// gate_stride]) when gate_logits is given, else 1. w: [n_out, k] bf16,
// x: [tokens, k] bf16, y: [tokens, n_out] f32 (accumulate: add to y).
Status dense_gemv_bf16(const __nv_bfloat16* w, const __nv_bfloat16* x, float* y, int tokens, int n_out, int k,
                       bool accumulate, const float* gate_logits, int gate_stride, cudaStream_t stream);

// The same with the input made inside the kernel while it is staged, saving
// a launch: RMSNorm of the f32 residual x_f32 [tokens, k] with norm_w [k]
// (xn_out [tokens, k] bf16, if given, receives the normed input for other
// consumers), or silu(gate) * up of gate_up [tokens, gate_up_stride] (gate
// at columns [0, k), up at [k, 2k)).
Status dense_gemv_bf16_rmsnorm(const __nv_bfloat16* w, const float* x_f32, const __nv_bfloat16* norm_w, float eps,
                               __nv_bfloat16* xn_out, float* y, int tokens, int n_out, int k, bool accumulate,
                               const float* gate_logits, int gate_stride, cudaStream_t stream);
Status dense_gemv_bf16_silu(const __nv_bfloat16* w, const float* gate_up, int gate_up_stride, float* y, int tokens,
                            int n_out, int k, bool accumulate, const float* gate_logits, int gate_stride,
                            cudaStream_t stream);

// INT8 weights with one f32 scale per output row (symmetric: W[n, i] ~=
// row_scale[n] * q[n, i], q in [-127, 127]), half the bytes of bf16. The
// same GEMVs as above, with each row's sum scaled before the gate and the
// accumulate. w: [n_out, k] int8, 16-byte aligned, k a multiple of 16.
Status dense_gemv_i8(const int8_t* w, const float* row_scale, const __nv_bfloat16* x, float* y, int tokens,
                     int n_out, int k, bool accumulate, const float* gate_logits, int gate_stride,
                     cudaStream_t stream);
Status dense_gemv_i8_rmsnorm(const int8_t* w, const float* row_scale, const float* x_f32,
                             const __nv_bfloat16* norm_w, float eps, __nv_bfloat16* xn_out, float* y, int tokens,
                             int n_out, int k, bool accumulate, const float* gate_logits, int gate_stride,
                             cudaStream_t stream);
Status dense_gemv_i8_silu(const int8_t* w, const float* row_scale, const float* gate_up, int gate_up_stride,
                          float* y, int tokens, int n_out, int k, bool accumulate, const float* gate_logits,
                          int gate_stride, cudaStream_t stream);

// INT4 weights: matrix `m` (n_out = m.rows, k = m.cols) of `blob`, codes
// 16-byte aligned, m.cols a multiple of 32 and at most dense_gemv_q4_max_k
// (the staged input's shared memory), m.group a power-of-two multiple of 32
// (a 16-byte run of codes lies in one group). A chunk of 32 inputs is
// summed in half2 against the codes, inputs scaled by the chunk's max |x|,
// then scale and bias applied in f32: ~1e-3 relative against the
// dequantised matrix. A quarter of bf16's bytes, plus 4 a group.
int dense_gemv_q4_max_k(int tokens);
Status dense_gemv_q4(const uint8_t* blob, const Q4MatrixLayout& m, const __nv_bfloat16* x, float* y, int tokens,
                     bool accumulate, const float* gate_logits, int gate_stride, cudaStream_t stream);
Status dense_gemv_q4_rmsnorm(const uint8_t* blob, const Q4MatrixLayout& m, const float* x_f32,
                             const __nv_bfloat16* norm_w, float eps, __nv_bfloat16* xn_out, float* y, int tokens,
                             bool accumulate, const float* gate_logits, int gate_stride, cudaStream_t stream);
Status dense_gemv_q4_silu(const uint8_t* blob, const Q4MatrixLayout& m, const float* gate_up, int gate_up_stride,
                          float* y, int tokens, bool accumulate, const float* gate_logits, int gate_stride,
                          cudaStream_t stream);
// out[r, i] = bf16(code * scale + bias) for matrix `m` of `blob` (the same
// shape rules; out 16-byte aligned).
Status dequantize_q4(const uint8_t* blob, const Q4MatrixLayout& m, __nv_bfloat16* out, cudaStream_t stream);

// Quantises bf16 w [n_out, k] (load time): row_scale[n] = max_i |w[n, i]| /
// 127 (f32), q[n, i] = w[n, i] / row_scale[n] rounded to nearest (ties to
// even) and clamped to [-127, 127]; an all-zero row gets scale 0. Any shape.
Status quantize_rows_i8(const __nv_bfloat16* w, int n_out, int k, int8_t* q, float* row_scale,
                        cudaStream_t stream);
// out[n, i] = bf16(row_scale[n] * q[n, i]) (for the cuBLASLt prefill path).
// Any shape; fastest with k % 8 == 0, q 8-byte and out 16-byte aligned.
Status dequantize_rows_i8(const int8_t* q, const float* row_scale, int n_out, int k, __nv_bfloat16* out,
                          cudaStream_t stream);

// Owns a cuBLASLt handle and a workspace; one per device and user. The
// algorithm for each shape is chosen once and kept. Not thread-safe.
class CublasLtMatmul {
 public:
  static Result<CublasLtMatmul*> create(size_t workspace_bytes = 32u << 20);
  ~CublasLtMatmul();
  CublasLtMatmul(const CublasLtMatmul&) = delete;
  CublasLtMatmul& operator=(const CublasLtMatmul&) = delete;

  // y[m, n] = x[m, k] W[n, k]^T (+ beta * y). x, w bf16; y bf16 or f32
  // (y_f32 selects). beta 0 or 1.
  Status matmul(const __nv_bfloat16* x, const __nv_bfloat16* w, void* y, bool y_f32, int m, int n, int k,
                float beta, cudaStream_t stream);

 private:
  CublasLtMatmul() = default;
  cublasLtHandle_t handle_ = nullptr;
  void* workspace_ = nullptr;
  size_t workspace_bytes_ = 0;
  std::map<std::tuple<int, int, int, bool, bool>, cublasLtMatmulAlgo_t> algos_;
};

}  // namespace moe::cuda
