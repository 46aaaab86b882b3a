#pragma once
// Experts under a VRAM budget for the benchmark: every expert blob lives in
// host memory (pinned where it lies), an IslandArena holds as many as the
// budget leaves room for, and the worker's ResidencyMap decides which. The
// routing is seeded uniform random (drawn here, on the host), so the hit rate
// is what a budget gives when no expert is more popular than another.
//
// Per MoE layer l of a step, at the point where the GPU has computed l's
// router (the host waits for it there, as a real worker must before it knows
// which experts to fetch):
//   1. l's experts are acquired and pinned; misses are copied on the copy
//      stream, and the compute stream waits for each island's copy;
//   2. a prediction of layer l+1's experts is hinted, and its copies queue
//      behind l's on the copy stream, overlapping l's expert compute and
//      l+1's attention. The prediction stands for "l+1's router applied to
//      l's hidden state": each of l+1's true picks is guessed right with
//      probability `predict_accuracy`, else a wrong expert is guessed;
//   3. after l's expert kernels are enqueued, l's islands are released.

#include <cuda_runtime.h>

#include <cstdint>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "bench/gpu/bench_model.h"
#include "gpu_worker/island_arena.h"
#include "gpu_worker/residency.h"
#include "model/result.h"

namespace moe::bench {

struct BudgetOptions {
  size_t islands_bytes = 0;  // device bytes for expert islands
  int n_layers = 0, n_experts = 0, top_k = 0, max_tokens = 0;
  size_t blob_bytes = 0;
  const uint8_t* host_experts = nullptr;  // [n_layers * n_experts * blob_bytes]
  std::string policy = "ours";            // lru | lfu | ours
  double predict_accuracy = 0.8;          // 0: no prefetch
  uint64_t seed = 42;
  // Prefetch copies as one batch (waits, then copies back to back, then one
  // event) instead of IslandArena::prefetch's wait/copy/record per expert.
  bool batched_prefetch = true;
  // Layers hinted ahead for a prompt (more than 8 tokens): a prompt needs
  // nearly every expert of every layer, so the copy queue can run further
  // ahead than one layer without a real prediction. Decode hints one layer.
  int prefill_lookahead = 4;
};

class BudgetExperts final : public ExpertProvider {
 public:
  static Result<std::unique_ptr<BudgetExperts>> create(const BudgetOptions& o);
  ~BudgetExperts() override;

  Result<ExpertBinding> bind(int layer, int tokens, cudaStream_t st) override;
  Status unbind(int layer, cudaStream_t st) override;
  // A new step (decode token or prompt) begins: routes are drawn afresh.
  void begin_step() { have_next_ = false; }

  const ResidencyStats& stats() const { return map_->stats(); }
  int64_t n_islands() const { return arena_->plan().n_islands; }
  bool host_registered() const { return arena_->host_registered(); }
  const IslandPlan& plan() const { return arena_->plan(); }
  Status synchronize() { return arena_->synchronize(); }

 private:
  BudgetExperts() = default;
  void draw_routes(int tokens, std::vector<int32_t>& out);
  Status prefetch_batch(int layer, const std::vector<int>& experts);

  BudgetOptions o_;
  std::unique_ptr<IslandArena> arena_;
  std::unique_ptr<ResidencyMap> map_;
  std::mt19937_64 rng_;
  size_t pack_bytes_ = 0;                    // [n_experts pointers | max_tokens * top_k ids]
  uint8_t* pack_host_ = nullptr;             // [n_layers * pack_bytes_] pinned
  uint8_t* pack_dev_ = nullptr;              // [n_layers * pack_bytes_]
  cudaEvent_t routed_ = nullptr;             // the router point of the current layer
  std::vector<cudaEvent_t> layer_read_;      // [layer] its expert kernels, last enqueued
  std::vector<cudaEvent_t> batch_done_;      // [layer] its last prefetch batch landed
  std::vector<int32_t> cur_;                 // [tokens * top_k] routes of this layer
  std::vector<std::vector<int32_t>> ahead_;  // routes of the next layers, drawn in layer order
  bool have_next_ = false;
  std::vector<std::vector<int>> bound_;  // [layer] distinct experts pinned for it
};

}  // namespace moe::bench
