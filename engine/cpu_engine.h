#pragma once
// The CPU inference engine (an Engine, engine/engine.h): the model's
// weights, a paged KV cache shared by many sequences, the batched forward
// pass and sampling. It is the reference
// the GPU kernels are tested against, the engine of the CPU fallback worker,
// and what the server runs on a machine without a GPU.
//
// Thread ownership: an engine is driven by one thread at a time (step,
// forward_logits, release); it uses its own worker threads inside a call.

#include <cstddef>
#include <cstdint>
#include <functional>
#include <atomic>
#include <memory>
#include <optional>
#include <span>
#include <unordered_map>
#include <utility>
#include <vector>

#include "engine/engine.h"
#include "kernels/kv_code.h"
#include "engine/forward.h"
#include "model/model_files.h"
#include "model/result.h"

namespace moe {

struct EngineOptions {
  int threads = 0;    // 0: all cores
  int kv_blocks = 0;  // 0: as many as kv_bytes_budget holds
  int kv_block_tokens = 16;
  std::optional<bool> experts_q4;  // unset: INT4 experts when the file has them
  size_t kv_bytes_budget = size_t(256) << 20;
  // Float weights are converted to f32 at load when they take at most this
  // many bytes as f32; larger models read bf16 in place.
  size_t f32_weights_max_bytes = size_t(4) << 30;
  bool prefix_cache = true;  // reuse cached KV blocks of shared prompt prefixes (docs/prefix-cache.md)
  KvDtype kv_dtype = KvDtype::bf16;  // bf16: f32 rows; int8 / fp8: coded rows (docs/kv-cache.md)
};

class CpuEngine final : public Engine {
 public:
  static Result<std::unique_ptr<CpuEngine>> create(std::shared_ptr<ModelFiles> files,
                                                   const EngineOptions& opts);

  Result<std::vector<SeqOutput>> step(std::span<const SeqInput> inputs) override;

  // Logits [T, vocab] at every position of a fresh sequence of `tokens`
  // (tests, perplexity). `trace` receives hidden states and router logits.
  Result<std::vector<float>> forward_logits(std::span<const int32_t> tokens,
                                            ForwardTrace* trace = nullptr);

  void release(uint64_t seq_id) override { kv_pool_->release(seq_id); }
  void set_progress(std::atomic<uint64_t>* progress) override;
  const ModelDesc& desc() const override { return files_->desc(); }
  int max_context() const override { return max_context_; }
  const KvBlockPool& kv_pool() const override { return *kv_pool_; }

  bool experts_q4() const { return weights_->experts_q4; }
  const ModelWeights& weights() const { return *weights_; }
  int threads() const { return pool_->size(); }

 private:
  CpuEngine() = default;

  std::shared_ptr<ModelFiles> files_;
  std::unique_ptr<ModelWeights> weights_;
  std::unique_ptr<cpu::ThreadPool> pool_;
  std::unique_ptr<KvCache> kv_;
  std::unique_ptr<ForwardPass> pass_;
  std::unique_ptr<KvBlockPool> kv_pool_;
  int max_context_ = 0;
  bool prefix_cache_ = true;
};

}  // namespace moe
