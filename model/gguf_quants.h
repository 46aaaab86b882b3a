#pragma once
// The ggml tensor types a GGUF file may hold: their ids, block sizes and
// byte sizes; dequantisation of the types we read (F32, F16, BF16, Q4_0,
// Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K) to f32; and the lossless move of
// the 4-bit ones (Q4_0, Q4_1, Q4_K) into our INT4 layout (docs/gguf.md).

#include <cstddef>
#include <cstdint>

#include "model/int4.h"

namespace moe {

enum GgmlType : uint32_t {
  kGgmlF32 = 0,
  kGgmlF16 = 1,
  kGgmlQ4_0 = 2,
  kGgmlQ4_1 = 3,
  kGgmlQ5_0 = 6,
  kGgmlQ5_1 = 7,
  kGgmlQ8_0 = 8,
  kGgmlQ8_1 = 9,
  kGgmlQ2_K = 10,
  kGgmlQ3_K = 11,
  kGgmlQ4_K = 12,
  kGgmlQ5_K = 13,
  kGgmlQ6_K = 14,
  kGgmlQ8_K = 15,
  kGgmlBF16 = 30,
};

struct GgmlTypeInfo {
  uint32_t id;
  const char* name;    // ggml's spelling: "Q4_K", "BF16", ...
  int block_elems;     // values per block (1 for plain floats)
  int block_bytes;     // bytes per block
  bool dequantizable;  // gguf_dequantize_row reads it
};

// nullptr for an id this table does not know. Known but unread types
// (IQ*, Q2_K, Q3_K, …) are listed with dequantizable = false, so errors can
// name them.
const GgmlTypeInfo* ggml_type_info(uint32_t id);
size_t ggml_row_bytes(const GgmlTypeInfo& t, int64_t n);
// "F32, F16, BF16, Q4_0, …": the types gguf_dequantize_row reads.
const char* gguf_readable_types();

// Dequantises `n` values (a multiple of the type's block) starting at `src`
// into out[n]. The type must be dequantizable.
void gguf_dequantize_row(uint32_t type, const uint8_t* src, int64_t n, float* out);

// True when a [rows, cols] matrix of `type` moves into our INT4 layout with
// its codes unchanged: Q4_0, Q4_1 and Q4_K, into groups of 32.
bool gguf_maps_to_q4(uint32_t type, int group);

// Writes the matrix W [rows, cols] of `type` at `src` (rows of
// ggml_row_bytes each) into `m`'s regions of `blob`: by moving the codes
// where gguf_maps_to_q4 (the scales and offsets become halves: exact for
// Q4_0/Q4_1, within half rounding of ggml's products for Q4_K), otherwise by
// dequantising and quantising with q4_quantize_matrix. Row-parallel callers
// may pass a row range.
void gguf_to_q4_rows(uint32_t type, const uint8_t* src, const Q4MatrixLayout& m, int row_begin, int row_end,
                     uint8_t* blob);

}  // namespace moe
