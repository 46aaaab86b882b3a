#pragma once
// INT4 expert weights: the layout (docs/int4-experts.md), the quantiser and
// the CPU dequantiser. Producers and consumers all compute offsets here.

#include <cstddef>
#include <cstdint>
#include <vector>

namespace moe {

// One quantised matrix W [rows, cols] (rows = outputs, cols = inputs = K),
// relative to the start of its expert blob.
struct Q4MatrixLayout {
  int rows = 0, cols = 0;
  int group = 0;             // effective group size along cols
  size_t codes_offset = 0;   // u8 [rows, cols/2]
  size_t params_offset = 0;  // half2 [rows, cols/group]: (scale, bias)
  size_t codes_bytes() const { return size_t(rows) * size_t(cols) / 2; }
  size_t params_bytes() const { return size_t(rows) * size_t(cols / group) * 4; }
};

// One expert: gate [inter, hidden], up [inter, hidden], down [hidden, inter],
// each region 256-byte aligned, blob_bytes a multiple of 256.
struct ExpertLayout {
  int hidden = 0, inter = 0, group = 0;  // group: the requested group size
  Q4MatrixLayout gate, up, down;
  size_t blob_bytes = 0;
};

constexpr size_t kQ4Align = 256;

// The effective group size for a K-wide row: the largest power of two <= group
// that divides k (at least 2). Requires k even.
int q4_effective_group(int k, int group);

ExpertLayout expert_layout(int hidden, int inter, int group);

// One matrix on its own (a dense layer's weights in INT4, not an expert):
// codes at offset 0, params at the next 256-byte boundary.
Q4MatrixLayout q4_matrix_layout(int rows, int cols, int group);
// Bytes from the codes' start to the params' end.
size_t q4_matrix_bytes(const Q4MatrixLayout& m);
// Rows [r0, r0 + n) of `m` as a matrix of their own, offsets still counted
// from m's base (both regions are row-major).
Q4MatrixLayout q4_row_slice(const Q4MatrixLayout& m, int r0, int n);

// Quantises W [rows, cols] (f32, row-major) into `m`'s regions of `blob`.
void q4_quantize_matrix(const float* w, const Q4MatrixLayout& m, uint8_t* blob);

// Writes group g of row `row` of `m` as given: codes[m.group] (each 0..15)
// and the bits of its (scale, bias) halves. For readers that carry a file's
// own 4-bit codes over (GPTQ/AWQ, GGUF) instead of quantising.
void q4_store_group(const Q4MatrixLayout& m, uint8_t* blob, int row, int g, const uint8_t* codes,
                    uint16_t scale_bits, uint16_t bias_bits);

// Dequantises row `row` of matrix `m` into out[cols].
void q4_dequantize_row(const uint8_t* blob, const Q4MatrixLayout& m, int row, float* out);

// y[rows] = W x[cols] straight from the codes (the CPU engine's expert matvec).
void q4_matvec(const uint8_t* blob, const Q4MatrixLayout& m, const float* x, float* y);
// Rows [row_begin, row_end) of the same: y[r] for r in the range (a slice
// of the rows per thread). With col_end in (0, cols), a multiple of the
// group: the sum over the first col_end inputs only.
void q4_matvec_rows(const uint8_t* blob, const Q4MatrixLayout& m, const float* x, int row_begin, int row_end,
                    float* y, int col_end = 0);
// The same with x's per-group sums given (q4_group_sums over the same
// col_end): callers that run many row ranges or matrices of one layout
// against one x pay for them once.
void q4_group_sums(const Q4MatrixLayout& m, const float* x, int col_end, float* sums);
void q4_matvec_rows_summed(const uint8_t* blob, const Q4MatrixLayout& m, const float* x, const float* x_sums,
                           int row_begin, int row_end, float* y, int col_end = 0);

// x quantised for q4_matvec_rows_q8: per block of 32 inputs (or of the
// matrix's group, when that is smaller) an int8 vector with one f32 scale
// (max |x| / 127), and the block's exact f32 sum (the bias term keeps full
// precision).
struct Q8Input {
  int block = 0;
  std::vector<int8_t> q;     // [cols]
  std::vector<float> scale;  // [cols / block]
  std::vector<float> sum;    // [cols / block]
  // With blocks of 32 and cols a multiple of 64: q again, each run of 64
  // inputs as its 32 even then its 32 odd ones, the order of the low and
  // high nibbles of 32 code bytes (the AVX2 path needs no unpacking then).
  std::vector<int8_t> q_split;
};
// block: 32, or the matrix's group when it is smaller (q8_block gives it).
int q8_block(const Q4MatrixLayout& m);
void q8_quantize(const float* x, int cols, int block, Q8Input* out);

// Rows [row_begin, row_end) of W x with x quantised (xq.block ==
// q8_block(m)): integer dot products (AVX2 maddubs when groups are a
// multiple of 32), a few times faster than q4_matvec_rows for ~0.4 % error
// per input. With col_end in (0, cols), a multiple of the group: the sum
// over the first col_end inputs only (x then holds those).
void q4_matvec_rows_q8(const uint8_t* blob, const Q4MatrixLayout& m, const Q8Input& xq, int row_begin, int row_end,
                       float* y, int col_end = 0);

}  // namespace moe
