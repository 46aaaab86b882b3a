#pragma once
// Which KV blocks each sequence owns and which are free: the bookkeeping
// every engine shares (the storage is each engine's own: KvCache on the
// host, pools in the arena on the device), and the checks a step passes
// against it before anything changes. Free block ids are a stack: the
// lowest ids go first, the most recently freed is reused first.
//
// Not thread-safe: owned by one engine, used from its calling thread.

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "engine/step.h"
#include "model/result.h"

namespace moe {

class KvBlockPool {
 public:
  KvBlockPool(int n_blocks, int block_tokens);

  int total() const { return n_blocks_; }
  int free() const { return int(free_.size()); }
  int block_tokens() const { return block_tokens_; }
  int blocks_for(int tokens) const { return (tokens + block_tokens_ - 1) / block_tokens_; }

  int sequences() const { return int(seqs_.size()); }  // those holding tokens
  int length(uint64_t seq) const;  // tokens held, -1 when the sequence is unknown
  int owned(uint64_t seq) const;   // blocks held, 0 when unknown
  const std::vector<int32_t>& table(uint64_t seq) const;  // its block table (empty when unknown)

  // The sequence now holds `end` tokens written from `start_pos` (0: what it
  // held is given back first), with blocks taken to cover them; returns its
  // block table. Only for inputs a check admitted: a shortfall aborts.
  const std::vector<int32_t>& extend(uint64_t seq, int start_pos, int end);
  void release(uint64_t seq);  // unknown ids are ignored

  // Blocks outside any sequence (a one-off forward pass); nullopt when too
  // few are free. `give_back` returns them.
  std::optional<std::vector<int32_t>> take(int n);
  void give_back(std::span<const int32_t> blocks);

 private:
  struct Held {
    std::vector<int32_t> blocks;
    int length = 0;
  };
  int n_blocks_, block_tokens_;
  std::vector<int32_t> free_;
  std::unordered_map<uint64_t, Held> seqs_;
};

// Why a step's input cannot run now; the worker answers each with its own
// protocol error.
enum class Refusal { none, invalid_input, unknown_sequence, context_exceeded, kv_full };

struct Admission {
  Refusal refusal = Refusal::none;
  std::string message;  // says what, without naming the sequence
  bool ok() const { return refusal == Refusal::none; }
};

// One step's inputs checked in turn against a pool: ids distinct, tokens
// present and in the vocabulary, start_pos 0 or the held length, the
// context, and KV blocks (a restart at 0 gives back what it held).
class StepAdmission {
 public:
  StepAdmission(const KvBlockPool& pool, int vocab, int max_context) : pool_(pool), vocab_(vocab), max_context_(max_context) {}
  // The input's checks, and its blocks against what the inputs admitted
  // before it left free; admitted, it counts against the next.
  Admission admit(const SeqInput& in);
  // Every check but the blocks; `net_blocks` receives what it would take
  // (negative when a restart gives back more than it needs).
  Admission check(const SeqInput& in, int* net_blocks);

 private:
  const KvBlockPool& pool_;
  int vocab_, max_context_;
  std::unordered_set<uint64_t> seen_;
  int net_blocks_ = 0;
};

// The checks every engine's step makes before it touches any state: each
// input's, and the whole step's blocks against the free ones. The first
// failure is the error, naming its sequence.
Status check_step_inputs(std::span<const SeqInput> inputs, const KvBlockPool& pool, int vocab, int max_context);

}  // namespace moe
