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

// Its hub config.json's figures (docs/cuda-mla.md): 15.7 B parameters.
ModelShape deepseek_v2_lite() {
  ModelShape s{"DeepSeek-V2-Lite", 2048, 27, 16, 16, 128, 64, 6, 1408, 2816, false, false, false, 102400, 1e4f};
  s.kv_lora_rank = 512;
  s.qk_nope = 128;
  s.qk_rope = 64;
  s.v_head = 128;
  s.first_dense = 1;
  s.dense_inter = 10944;
  s.yarn_factor = 40.f;
  return s;
}

}  // namespace moe::bench
