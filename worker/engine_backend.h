#pragma once
// A Backend over an Engine (engine/engine.h): what the CPU and the CUDA
// backends answer alike, from the engine itself: the hello, KV counts, the
// sequences held, release and progress. Each backend adds its own step
// bookkeeping and expert residency.

#include <atomic>
#include <cstdint>
#include <string>
#include <utility>

#include "engine/engine.h"
#include "worker/backend.h"
#include "worker/step_translation.h"

namespace moe::worker {

class EngineBackend : public Backend {
 public:
  protocol::Hello describe() const override { return engine_hello(engine_, model_id_, backend_name_); }
  void release(uint64_t seq_id) override { engine_.release(seq_id); }
  int kv_blocks_total() const override { return engine_.kv_blocks_total(); }
  int kv_blocks_free() const override { return engine_.kv_blocks_free(); }
  int sequences_active() const override { return engine_.kv_pool().sequences(); }
  void set_progress(std::atomic<uint64_t>* progress) override {
    Backend::set_progress(progress);
    engine_.set_progress(progress);
  }

 protected:
  // `engine` outlives this object (the derived backend owns it).
  EngineBackend(Engine& engine, std::string model_id, const char* backend_name)
      : engine_(engine), model_id_(std::move(model_id)), backend_name_(backend_name) {}

 private:
  Engine& engine_;
  std::string model_id_;
  const char* backend_name_;
};

}  // namespace moe::worker
