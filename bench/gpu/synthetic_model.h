#pragma once
// A whole model of a real shape with seeded random weights, held in host
// memory and seen through ModelFiles::from_memory, so that the worker's own
// CudaEngine can be benchmarked at 14-30 B parameters without a checkpoint:
// float tensors bf16 under their Hugging Face names, routed experts INT4
// blobs (random codes; scale 1/(4.6 sqrt(fan_in)), offset -7.5 scale, so that
// activations stay O(1) through the layers).

#include <cstdint>
#include <memory>
#include <vector>

#include "bench/gpu/model_shapes.h"
#include "model/model_files.h"
#include "model/result.h"

namespace moe::bench {

struct SyntheticModel {
  std::shared_ptr<ModelFiles> files;
  std::vector<std::vector<uint8_t>> storage;  // what the tensors point into
  uint8_t* experts = nullptr;                 // one page-aligned block of every blob
  size_t expert_bytes = 0;
  ~SyntheticModel();
};

// Qwen2-MoE (shared expert) or Qwen3-MoE layout, from the shape's fields.
Result<std::unique_ptr<SyntheticModel>> make_synthetic_model(const ModelShape& s, uint64_t seed, int group = 64);

}  // namespace moe::bench
