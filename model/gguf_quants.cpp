#include "model/gguf_quants.h"

#include <cstring>
#include <vector>

#include "model/safetensors.h"

namespace moe {

namespace {

// K-quants: 256 values per super-block.
constexpr int kQK = 256;

const GgmlTypeInfo kTypes[] = {
    {kGgmlF32, "F32", 1, 4, true},
    {kGgmlF16, "F16", 1, 2, true},
    {kGgmlQ4_0, "Q4_0", 32, 18, true},
    {kGgmlQ4_1, "Q4_1", 32, 20, true},
    {kGgmlQ5_0, "Q5_0", 32, 22, true},
    {kGgmlQ5_1, "Q5_1", 32, 24, true},
    {kGgmlQ8_0, "Q8_0", 32, 34, true},
    {kGgmlQ8_1, "Q8_1", 32, 36, false},
    {kGgmlQ2_K, "Q2_K", kQK, 84, false},
    {kGgmlQ3_K, "Q3_K", kQK, 110, false},
    {kGgmlQ4_K, "Q4_K", kQK, 144, true},
    {kGgmlQ5_K, "Q5_K", kQK, 176, true},
    {kGgmlQ6_K, "Q6_K", kQK, 210, true},
    {kGgmlQ8_K, "Q8_K", kQK, 292, false},
    {16, "IQ2_XXS", kQK, 66, false},
    {17, "IQ2_XS", kQK, 74, false},
    {18, "IQ3_XXS", kQK, 98, false},
    {19, "IQ1_S", kQK, 50, false},
    {20, "IQ4_NL", 32, 18, false},
    {21, "IQ3_S", kQK, 110, false},
    {22, "IQ2_S", kQK, 82, false},
    {23, "IQ4_XS", kQK, 136, false},
    {24, "I8", 1, 1, false},
    {25, "I16", 1, 2, false},
    {26, "I32", 1, 4, false},
    {27, "I64", 1, 8, false},
    {28, "F64", 1, 8, false},
    {29, "IQ1_M", kQK, 56, false},
    {kGgmlBF16, "BF16", 1, 2, true},
    {34, "TQ1_0", kQK, 54, false},
    {35, "TQ2_0", kQK, 66, false},
    {39, "MXFP4", 32, 17, false},
};

float half_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return f16_to_f32(h);
}

uint16_t half_bits_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return h;
}

// The 6-bit scale and min of sub-block j (0..7) of a Q4_K / Q5_K
// super-block: the first four are the low 6 bits of bytes 0..3 (scales) and
// 4..7 (mins); the last four take their low 4 bits from bytes 8..11 and
// their high 2 bits from the top of bytes 0..7.
void k_scale_min(int j, const uint8_t* s, int* scale, int* min) {
  if (j < 4) {
    *scale = s[j] & 63;
    *min = s[j + 4] & 63;
  } else {
    *scale = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
    *min = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

// Sub-block j's value of code q is scale * q - offset (Q4_K, Q5_K: d and
// dmin are the super-block's two halves at its start, the packed scales follow).
struct KSubBlock {
  float scale, offset;
};
KSubBlock k_sub_block(const uint8_t* block, int j) {
  int sc, m;
  k_scale_min(j, block + 4, &sc, &m);
  return {half_at(block) * float(sc), half_at(block + 2) * float(m)};
}

// Block layouts, by field offset within a block.
//  Q4_0: d f16 | qs[16]                 value j: low nibble of qs[j] (j < 16), high of qs[j-16]
//  Q4_1: d f16 | m f16 | qs[16]
//  Q5_0: d f16 | qh u32 | qs[16]         bit j of qh is bit 4 of value j
//  Q5_1: d f16 | m f16 | qh u32 | qs[16]
//  Q8_0: d f16 | qs i8[32]
//  Q4_K: d f16 | dmin f16 | scales[12] | qs[128]
//  Q5_K: d f16 | dmin f16 | scales[12] | qh[32] | qs[128]
//  Q6_K: ql[128] | qh[64] | scales i8[16] | d f16

void dequant_q4_0(const uint8_t* b, float* y) {
  const float d = half_at(b);
  const uint8_t* qs = b + 2;
  for (int j = 0; j < 16; ++j) {
    y[j] = float((qs[j] & 0xF) - 8) * d;
    y[j + 16] = float((qs[j] >> 4) - 8) * d;
  }
}

void dequant_q4_1(const uint8_t* b, float* y) {
  const float d = half_at(b), m = half_at(b + 2);
  const uint8_t* qs = b + 4;
  for (int j = 0; j < 16; ++j) {
    y[j] = float(qs[j] & 0xF) * d + m;
    y[j + 16] = float(qs[j] >> 4) * d + m;
  }
}

void dequant_q5(const uint8_t* b, bool has_min, float* y) {
  const float d = half_at(b);
  const float m = has_min ? half_at(b + 2) : 0.0f;
  const uint8_t* p = b + (has_min ? 4 : 2);
  uint32_t qh;
  std::memcpy(&qh, p, 4);
  const uint8_t* qs = p + 4;
  const int offset = has_min ? 0 : 16;
  for (int j = 0; j < 16; ++j) {
    const int lo = (qs[j] & 0xF) | int(((qh >> j) & 1) << 4);
    const int hi = (qs[j] >> 4) | int(((qh >> (j + 16)) & 1) << 4);
    y[j] = float(lo - offset) * d + m;
    y[j + 16] = float(hi - offset) * d + m;
  }
}

void dequant_q8_0(const uint8_t* b, float* y) {
  const float d = half_at(b);
  const int8_t* qs = reinterpret_cast<const int8_t*>(b + 2);
  for (int j = 0; j < 32; ++j) y[j] = float(qs[j]) * d;
}

void dequant_q4_k(const uint8_t* b, float* y) {
  const uint8_t* q = b + 16;
  for (int chunk = 0; chunk < 4; ++chunk, q += 32, y += 64) {
    const KSubBlock s0 = k_sub_block(b, 2 * chunk), s1 = k_sub_block(b, 2 * chunk + 1);
    for (int l = 0; l < 32; ++l) {
      y[l] = s0.scale * float(q[l] & 0xF) - s0.offset;
      y[l + 32] = s1.scale * float(q[l] >> 4) - s1.offset;
    }
  }
}

void dequant_q5_k(const uint8_t* b, float* y) {
  const uint8_t* qh = b + 16;
  const uint8_t* ql = b + 48;
  for (int chunk = 0; chunk < 4; ++chunk, ql += 32, y += 64) {
    const KSubBlock s0 = k_sub_block(b, 2 * chunk), s1 = k_sub_block(b, 2 * chunk + 1);
    const int bit0 = 2 * chunk, bit1 = 2 * chunk + 1;
    for (int l = 0; l < 32; ++l) {
      y[l] = s0.scale * float((ql[l] & 0xF) | (((qh[l] >> bit0) & 1) << 4)) - s0.offset;
      y[l + 32] = s1.scale * float((ql[l] >> 4) | (((qh[l] >> bit1) & 1) << 4)) - s1.offset;
    }
  }
}

void dequant_q6_k(const uint8_t* b, float* y) {
  const uint8_t* ql = b;
  const uint8_t* qh = b + 128;
  const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
  const float d = half_at(b + 208);
  for (int half = 0; half < 2; ++half, ql += 64, qh += 32, sc += 8, y += 128) {
    for (int l = 0; l < 32; ++l) {
      const int s = l / 16;
      const int q0 = ((ql[l] & 0xF) | (((qh[l] >> 0) & 3) << 4)) - 32;
      const int q1 = ((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32;
      const int q2 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
      const int q3 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
      y[l] = d * float(sc[s]) * float(q0);
      y[l + 32] = d * float(sc[s + 2]) * float(q1);
      y[l + 64] = d * float(sc[s + 4]) * float(q2);
      y[l + 96] = d * float(sc[s + 6]) * float(q3);
    }
  }
}

// One block of Q4_0 / Q4_1 (32 values) → group g of row r.
void move_q4_01(uint32_t type, const uint8_t* b, const Q4MatrixLayout& m, uint8_t* blob, int r, int g) {
  const bool has_min = type == kGgmlQ4_1;
  const uint8_t* qs = b + (has_min ? 4 : 2);
  uint8_t q[32];
  for (int j = 0; j < 16; ++j) {
    q[j] = qs[j] & 0xF;
    q[j + 16] = qs[j] >> 4;
  }
  const uint16_t scale = half_bits_at(b);
  // Q4_0: w = d (q - 8) = q d + (-8 d); -8 d is exact in half (a power-of-two multiple).
  const uint16_t bias = has_min ? half_bits_at(b + 2) : f32_to_f16(-8.0f * half_at(b));
  q4_store_group(m, blob, r, g, q, scale, bias);
}

// One Q4_K super-block (256 values) → groups g0..g0+7 of row r.
void move_q4_k(const uint8_t* b, const Q4MatrixLayout& m, uint8_t* blob, int r, int g0) {
  const uint8_t* qs = b + 16;
  for (int chunk = 0; chunk < 4; ++chunk, qs += 32) {
    uint8_t lo[32], hi[32];
    for (int l = 0; l < 32; ++l) {
      lo[l] = qs[l] & 0xF;
      hi[l] = qs[l] >> 4;
    }
    const KSubBlock s0 = k_sub_block(b, 2 * chunk), s1 = k_sub_block(b, 2 * chunk + 1);
    q4_store_group(m, blob, r, g0 + 2 * chunk, lo, f32_to_f16(s0.scale), f32_to_f16(-s0.offset));
    q4_store_group(m, blob, r, g0 + 2 * chunk + 1, hi, f32_to_f16(s1.scale), f32_to_f16(-s1.offset));
  }
}

}  // namespace

const GgmlTypeInfo* ggml_type_info(uint32_t id) {
  for (const GgmlTypeInfo& t : kTypes)
    if (t.id == id) return &t;
  return nullptr;
}

size_t ggml_row_bytes(const GgmlTypeInfo& t, int64_t n) {
  return size_t(n / t.block_elems) * size_t(t.block_bytes);
}

const char* gguf_readable_types() { return "F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K"; }

void gguf_dequantize_row(uint32_t type, const uint8_t* src, int64_t n, float* out) {
  switch (type) {
    case kGgmlF32:
      std::memcpy(out, src, size_t(n) * 4);
      return;
    case kGgmlF16:
      for (int64_t i = 0; i < n; ++i) out[i] = half_at(src + 2 * i);
      return;
    case kGgmlBF16:
      for (int64_t i = 0; i < n; ++i) out[i] = bf16_to_f32(half_bits_at(src + 2 * i));
      return;
    default:
      break;
  }
  const GgmlTypeInfo* t = ggml_type_info(type);
  const int64_t blocks = n / t->block_elems;
  for (int64_t i = 0; i < blocks; ++i) {
    const uint8_t* b = src + size_t(i) * size_t(t->block_bytes);
    float* y = out + i * t->block_elems;
    switch (type) {
      case kGgmlQ4_0: dequant_q4_0(b, y); break;
      case kGgmlQ4_1: dequant_q4_1(b, y); break;
      case kGgmlQ5_0: dequant_q5(b, false, y); break;
      case kGgmlQ5_1: dequant_q5(b, true, y); break;
      case kGgmlQ8_0: dequant_q8_0(b, y); break;
      case kGgmlQ4_K: dequant_q4_k(b, y); break;
      case kGgmlQ5_K: dequant_q5_k(b, y); break;
      case kGgmlQ6_K: dequant_q6_k(b, y); break;
      default: std::memset(y, 0, size_t(t->block_elems) * 4); break;  // unreachable: callers check
    }
  }
}

bool gguf_maps_to_q4(uint32_t type, int group) {
  return group == 32 && (type == kGgmlQ4_0 || type == kGgmlQ4_1 || type == kGgmlQ4_K);
}

void gguf_to_q4_rows(uint32_t type, const uint8_t* src, const Q4MatrixLayout& m, int row_begin, int row_end,
                     uint8_t* blob) {
  const GgmlTypeInfo* t = ggml_type_info(type);
  const size_t row_bytes = ggml_row_bytes(*t, m.cols);
  if (gguf_maps_to_q4(type, m.group)) {
    for (int r = row_begin; r < row_end; ++r) {
      const uint8_t* row = src + size_t(r) * row_bytes;
      const int blocks = m.cols / t->block_elems;
      for (int i = 0; i < blocks; ++i) {
        const uint8_t* b = row + size_t(i) * size_t(t->block_bytes);
        if (type == kGgmlQ4_K)
          move_q4_k(b, m, blob, r, 8 * i);
        else
          move_q4_01(type, b, m, blob, r, i);
      }
    }
    return;
  }
  std::vector<float> rows(size_t(row_end - row_begin) * size_t(m.cols));
  for (int r = row_begin; r < row_end; ++r)
    gguf_dequantize_row(type, src + size_t(r) * row_bytes, m.cols,
                        rows.data() + size_t(r - row_begin) * size_t(m.cols));
  q4_quantize_matrix(rows.data(), q4_row_slice(m, row_begin, row_end - row_begin), blob);
}

}  // namespace moe
