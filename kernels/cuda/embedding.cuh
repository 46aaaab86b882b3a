#pragma once
// Token embedding lookup into the f32 residual stream.

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "model/result.h"

namespace moe::cuda {

// x[t, :] = table[tokens[t], :]. table: [vocab, hidden] bf16, x: [n_tokens,
// hidden] f32. An id outside [0, vocab) gives a zero row.
Status embedding_gather(const __nv_bfloat16* table, int vocab, int hidden, const int32_t* tokens, int n_tokens,
                        float* x, cudaStream_t stream);

// dst[i, :] = src[rows[i], :] for i < n_rows (f32 rows of `dim`): the
// positions a step samples from, out of the residual stream.
Status gather_rows_f32(const float* src, const int32_t* rows, int n_rows, int dim, float* dst,
                       cudaStream_t stream);

}  // namespace moe::cuda
