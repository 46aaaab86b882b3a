#pragma once
// What every engine is to its users (the worker's backends, the tools, the
// benchmarks): steps over many sequences at once on the contract of
// engine/step.h, with their KV blocks counted in a KvBlockPool. CpuEngine
// (engine/cpu_engine.h) and CudaEngine (cuda_engine/cuda_engine.h)
// implement it.
//
// Thread ownership: an engine is driven by one thread at a time.

#include <atomic>
#include <cstdint>
#include <span>
#include <vector>

#include "engine/kv_block_pool.h"
#include "engine/step.h"
#include "model/model_config.h"
#include "model/result.h"

namespace moe {

class Engine {
 public:
  virtual ~Engine() = default;

  // Runs one step for several sequences at once: each input's tokens are
  // appended at start_pos (0 discards any old state of that id), and a token
  // is sampled after the last where `sample` is set. Outputs are in input
  // order. Fails without changing any state when an input is inconsistent
  // (check_step_inputs) or the KV pool is short.
  virtual Result<std::vector<SeqOutput>> step(std::span<const SeqInput> inputs) = 0;
  // Frees a sequence's KV blocks (unknown ids are ignored).
  virtual void release(uint64_t seq_id) = 0;
  // A counter bumped as a step advances (the worker's sign of life during
  // long steps); nullptr: none.
  virtual void set_progress(std::atomic<uint64_t>* progress) = 0;

  virtual const ModelDesc& desc() const = 0;
  virtual int max_context() const = 0;
  virtual const KvBlockPool& kv_pool() const = 0;

  // KV blocks the engine can add before a step by taking room from its
  // expert islands (docs/kv-islands-trade.md); 0 where the pool is fixed.
  virtual int kv_blocks_growable() const { return 0; }
  // Called about once a second while no step runs: the CUDA engine gives
  // KV that stayed idle back to its islands there.
  virtual void idle() {}

  int kv_blocks_total() const { return kv_pool().total(); }
  int kv_blocks_free() const { return kv_pool().free(); }
  // What the worker announces: the most blocks it can reach, and of those
  // the ones no sequence holds (free now or growable).
  int kv_blocks_reachable() const { return kv_blocks_total() + kv_blocks_growable(); }
  int kv_blocks_available() const { return kv_blocks_free() + kv_blocks_growable(); }
  int kv_block_tokens() const { return kv_pool().block_tokens(); }
  int seq_length(uint64_t seq_id) const { return kv_pool().length(seq_id); }  // -1 when unknown
  // A step's inputs checked one by one against this engine (the worker
  // refuses each it cannot run with its own error).
  StepAdmission admission() const {
    return StepAdmission(kv_pool(), desc().vocab_size, max_context(), kv_blocks_growable());
  }
};

}  // namespace moe
