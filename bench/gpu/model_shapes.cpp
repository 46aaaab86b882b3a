#include "bench/gpu/model_shapes.h"

namespace moe::bench {

ModelShape qwen15_moe_a27b() {
  return {"Qwen1.5-MoE-A2.7B",
          2048,
          24,
          16,
          16,
          128,
          60,
          4,
          1408,
          5632,
          false,
          true,
          false,
          151936,
          1e6f};
}
ModelShape qwen3_30b_a3b() {
  return {"Qwen3-30B-A3B", 2048, 48, 32, 4, 128, 128, 8, 768, 0, true, false, true, 151936, 1e6f};
}

}  // namespace moe::bench
