#pragma once
// The CPU inference engine: the model's weights, a paged KV cache shared by
// many sequences, the batched forward pass and sampling. It is the reference
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

#include "engine/forward.h"
#include "model/model_files.h"
#include "model/result.h"

namespace moe {

struct SamplingParams {
  float temperature = 1;  // <= 0: greedy
  float top_p = 1;
  int top_k = 0;  // 0: no limit
  uint64_t seed = 0;
  int top_logprobs = 0;   // how many alternatives to report in SeqOutput::top
  bool logprobs = false;  // report the sampled token's log probability
};

struct SeqInput {
  uint64_t seq_id = 0;
  std::vector<int32_t> tokens;  // the new tokens of this step (prompt chunk or last sampled token)
  int32_t start_pos = 0;  // position of tokens[0] = the sequence's current length; 0 starts afresh
  bool sample = true;     // sample a next token after the last one
  SamplingParams sampling;
  // With `sample`: the token whose raw log probability at the next position
  // goes to SeqOutput::score_logprob (teacher-forced scoring: perplexity,
  // the cost of a quantisation); -1: none.
  int32_t score_token = -1;
};

struct SeqOutput {
  uint64_t seq_id = 0;
  int32_t token = -1;  // the sampled token, -1 when not sampling
  float logprob = 0;   // raw-model log probability of `token` (before temperature)
  std::vector<std::pair<int32_t, float>> top;  // [top_logprobs] best tokens, raw log probabilities
  float score_logprob = 0;  // raw log probability of SeqInput::score_token (when given)
  std::vector<uint16_t>
      expert_counts;  // [n_moe_layers * n_experts]: tokens of this step each expert served
};

struct EngineOptions {
  int threads = 0;    // 0: all cores
  int kv_blocks = 0;  // 0: as many as kv_bytes_budget holds
  int kv_block_tokens = 16;
  std::optional<bool> experts_q4;  // unset: INT4 experts when the file has them
  size_t kv_bytes_budget = size_t(256) << 20;
  // Float weights are converted to f32 at load when they take at most this
  // many bytes as f32; larger models read bf16 in place.
  size_t f32_weights_max_bytes = size_t(4) << 30;
};

// What an engine holds of a sequence, for check_step_inputs.
struct HeldSequence {
  int length = 0;  // tokens in the KV cache
  int blocks = 0;  // KV blocks owned
};

// The checks every engine's step makes before it touches any state: ids
// distinct, tokens present and in the vocabulary, start_pos 0 or the held
// length, the context, and enough free KV blocks (counting those a restart
// at 0 gives back). `held` returns the engine's view of a sequence, or
// nullopt when it has none.
Status check_step_inputs(std::span<const SeqInput> inputs, int vocab, int max_context, int block_tokens,
                         int free_blocks, const std::function<std::optional<HeldSequence>(uint64_t)>& held);

class CpuEngine {
 public:
  static Result<std::unique_ptr<CpuEngine>> create(std::shared_ptr<ModelFiles> files,
                                                   const EngineOptions& opts);

  // Runs one step for several sequences at once: each input's tokens are
  // appended at start_pos (0 discards any old state of that id), and a token
  // is sampled after the last where `sample` is set. Outputs are in input
  // order. Fails without changing any state when an input is inconsistent
  // (start_pos != length, an id twice, past max_context) or the KV cache has
  // too few free blocks.
  Result<std::vector<SeqOutput>> step(std::span<const SeqInput> inputs);

  // Logits [T, vocab] at every position of a fresh sequence of `tokens`
  // (tests, perplexity). `trace` receives hidden states and router logits.
  Result<std::vector<float>> forward_logits(std::span<const int32_t> tokens,
                                            ForwardTrace* trace = nullptr);

  // Frees a sequence's KV blocks (unknown ids are ignored).
  void release(uint64_t seq_id);

  int kv_blocks_total() const { return kv_->blocks_total(); }
  int kv_blocks_free() const { return kv_->blocks_free(); }
  int kv_block_tokens() const { return kv_->block_tokens(); }
  int max_context() const { return max_context_; }
  int seq_length(uint64_t seq_id) const;  // -1 when unknown
  const ModelDesc& desc() const { return files_->desc(); }
  bool experts_q4() const { return weights_->experts_q4; }
  int threads() const { return pool_->size(); }
  // A counter bumped after every layer of a forward pass (the worker's sign
  // of life during long steps); nullptr: none.
  void set_progress(std::atomic<uint64_t>* progress);

 private:
  struct Sequence {
    std::vector<int32_t> blocks;
    int32_t length = 0;
  };
  CpuEngine() = default;
  int blocks_for(int tokens) const {
    return (tokens + kv_->block_tokens() - 1) / kv_->block_tokens();
  }

  std::shared_ptr<ModelFiles> files_;
  std::unique_ptr<ModelWeights> weights_;
  std::unique_ptr<cpu::ThreadPool> pool_;
  std::unique_ptr<KvCache> kv_;
  std::unique_ptr<ForwardPass> pass_;
  std::unordered_map<uint64_t, Sequence> seqs_;
  int max_context_ = 0;
};

}  // namespace moe
