#pragma once
// Integer tensors of the reference files (tests/data/fixtures/<arch>/
// reference.safetensors: prompts, greedy ids) as int32 values, for every
// test that reads them.

#include <cstdint>
#include <cstring>
#include <vector>

#include "model/safetensors.h"

namespace moe::test {

// I64, I32 or I16 tensor as int32 values.
inline std::vector<int32_t> ints(const TensorView& t) {
  std::vector<int32_t> out(size_t(t.numel()));
  for (size_t i = 0; i < out.size(); ++i) {
    if (t.dtype == DType::i64) {
      int64_t v;
      std::memcpy(&v, t.data + 8 * i, 8);
      out[i] = int32_t(v);
    } else if (t.dtype == DType::i32) {
      std::memcpy(&out[i], t.data + 4 * i, 4);
    } else {
      int16_t v;
      std::memcpy(&v, t.data + 2 * i, 2);
      out[i] = v;
    }
  }
  return out;
}

}  // namespace moe::test
