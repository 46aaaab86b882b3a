#pragma once
// A Backend over an Engine (engine/engine.h): what the CPU and the CUDA
// backends answer alike, from the engine itself: the hello, KV counts, the
// sequences held, release and progress. Each backend adds its own step
// bookkeeping and expert residency.

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "engine/engine.h"
#include "worker/backend.h"
#include "worker/step_translation.h"

namespace moe::worker {

class EngineBackend : public Backend {
 public:
  protocol::Hello describe() const override { return engine_hello(engine_, model_id_, backend_name_); }
  void release(uint64_t seq_id) override { engine_.release(seq_id); }
  // As announced: the most the pool can reach, and what of it no sequence holds.
  int kv_blocks_total() const override { return engine_.kv_blocks_reachable(); }
  int kv_blocks_free() const override { return engine_.kv_blocks_available(); }
  void idle() override { engine_.idle(); }
  int sequences_active() const override { return engine_.kv_pool().sequences(); }
  void set_progress(std::atomic<uint64_t>* progress) override {
    Backend::set_progress(progress);
    engine_.set_progress(progress);
  }
  void count_expert_use(bool on) override { count_use_ = on; }
  const std::vector<uint64_t>& expert_use() const override { return use_; }
  uint64_t expert_use_tokens() const override { return use_tokens_; }

 protected:
  // `engine` outlives this object (the derived backend owns it).
  EngineBackend(Engine& engine, std::string model_id, const char* backend_name)
      : engine_(engine), model_id_(std::move(model_id)), backend_name_(backend_name) {}

  // Adds a step's expert use to the totals while counting is on (whether or
  // not the gateway asked for the use in the reply).
  void tally_expert_use(const std::vector<SeqOutput>& outputs) {
    if (!count_use_) return;
    const int top_k = std::max(engine_.desc().moe.top_k, 1);
    const size_t per_layer = size_t(engine_.desc().moe.n_experts);
    for (const SeqOutput& o : outputs) {
      if (o.expert_counts.empty()) continue;
      if (use_.size() < o.expert_counts.size()) use_.resize(o.expert_counts.size(), 0);
      uint64_t first_layer = 0;
      for (size_t i = 0; i < o.expert_counts.size(); ++i) {
        use_[i] += o.expert_counts[i];
        if (i < per_layer) first_layer += o.expert_counts[i];
      }
      use_tokens_ += first_layer / uint64_t(top_k);
    }
  }

 private:
  Engine& engine_;
  std::string model_id_;
  const char* backend_name_;
  bool count_use_ = false;
  std::vector<uint64_t> use_;  // step thread only
  uint64_t use_tokens_ = 0;
};

}  // namespace moe::worker
