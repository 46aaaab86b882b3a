#pragma once
// Which KV blocks each sequence owns and which are free: the bookkeeping
// every engine shares (the storage is each engine's own: KvCache on the
// host, pools in the arena on the device), and the checks a step passes
// against it before anything changes. Free block ids are a stack: the
// lowest ids go first, the most recently freed is reused first.
//
// Not thread-safe: owned by one engine, used from its calling thread.

#include <cstdint>
#include <list>
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
  // Blocks a sequence can take: never used, or holding a cached prefix no
  // sequence references (the least recently released of those go first).
  int free() const { return int(free_.size() + cached_.size()); }
  int block_tokens() const { return block_tokens_; }
  int blocks_for(int tokens) const { return (tokens + block_tokens_ - 1) / block_tokens_; }

  int sequences() const { return int(seqs_.size()); }  // those holding tokens
  int length(uint64_t seq) const;  // tokens held, -1 when the sequence is unknown
  int owned(uint64_t seq) const;   // blocks held, 0 when unknown
  // The blocks release(seq) would make free (or cached): those no other
  // sequence shares.
  int freed_by_release(uint64_t seq) const;
  const std::vector<int32_t>& table(uint64_t seq) const;  // its block table (empty when unknown)

  // The sequence now holds `end` tokens written from `start_pos` (0: what it
  // held is given back first), with blocks taken to cover them; returns its
  // block table. Only for inputs a check admitted: a shortfall aborts.
  const std::vector<int32_t>& extend(uint64_t seq, int start_pos, int end);
  // The same with the tokens written (end - start_pos of them): each block
  // they fill is hashed (the chain of its prefix's tokens, salted per pool)
  // and, once its sequence lets it go, kept as a cached prefix
  // (docs/prefix-cache.md).
  const std::vector<int32_t>& extend(uint64_t seq, int start_pos, int end, std::span<const int32_t> tokens);
  void release(uint64_t seq);  // unknown ids are ignored

  // Prefix cache. The whole blocks at the start of `tokens` whose KV some
  // block holds, leaving at least the last token to compute.
  int cached_prefix_blocks(std::span<const int32_t> tokens) const;
  // `seq` starts afresh holding those blocks (shared, read only): its next
  // tokens go from blocks * block_tokens().
  void attach_prefix(uint64_t seq, std::span<const int32_t> tokens, int blocks);
  // A step's inputs with those that continue a cached chain (a fresh
  // prompt, or the next chunk of one whose blocks so far are whole and
  // hashed) rewritten into *rewritten to start after the cached blocks,
  // which are attached; *skipped: the tokens skipped per input (empty when
  // none was: the inputs come back as given, nothing copied). Call after the
  // step's checks passed, before extend.
  std::span<const SeqInput> reuse_prefixes(std::span<const SeqInput> inputs, std::vector<SeqInput>* rewritten,
                                           std::vector<int>* skipped);
  uint64_t prefix_tokens_reused() const { return reused_tokens_; }

  // The pool's size at run time (docs/kv-islands-trade.md). grow adds `n`
  // free blocks, ids total() … total() + n - 1, handed out after the free
  // ones already there. shrink_free_tail gives back the blocks at the top of
  // the id range that no sequence holds (a cached prefix there is
  // forgotten) until total() is `target`, never below `floor`, stopping at
  // the first held block; returns the new total.
  void grow(int n);
  int shrink_free_tail(int target, int floor);
  // Gives back the blocks of every input that restarts at 0, before a
  // checked step extends any: its blocks are then the step's net total
  // (check_step_inputs), whatever the inputs' order.
  void release_restarts(std::span<const SeqInput> inputs);

  // Blocks outside any sequence (a one-off forward pass); nullopt when too
  // few are free. `give_back` returns them.
  std::optional<std::vector<int32_t>> take(int n);
  void give_back(std::span<const int32_t> blocks);

 private:
  struct Held {
    std::vector<int32_t> blocks;
    int length = 0;
    uint64_t chain = 0;            // hash of its whole blocks so far (0: not hashed: extend without tokens)
    bool hashing = false;
    std::vector<int32_t> partial;  // tokens of its block being filled
  };
  int32_t take_block();
  int cached_blocks_after(uint64_t chain, std::span<const int32_t> tokens) const;
  int reusable_blocks(const SeqInput& in) const;  // cached blocks that input could attach
  void attach_blocks(Held& h, std::span<const int32_t> tokens, int blocks);
  uint64_t block_hash(uint64_t chain, std::span<const int32_t> block) const;
  void unref(int32_t b);

  int n_blocks_, block_tokens_;
  std::vector<int32_t> free_;  // a min-heap: the lowest free id goes out first
  void put_free(int32_t b);
  std::unordered_map<uint64_t, Held> seqs_;
  // Prefix cache: per block its references and hash (0: none); the hashes'
  // blocks; unreferenced hashed blocks in release order, and where each sits.
  std::vector<int> refs_;
  std::vector<uint64_t> hash_;
  std::unordered_map<uint64_t, int32_t> by_hash_;
  std::list<int32_t> cached_;
  std::vector<std::list<int32_t>::iterator> cached_at_;
  uint64_t salt_ = 0;
  uint64_t reused_tokens_ = 0;
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
// `headroom`: blocks the engine can add to the pool before the step runs
// (KV taking expert islands, docs/kv-islands-trade.md), counted as free.
class StepAdmission {
 public:
  StepAdmission(const KvBlockPool& pool, int vocab, int max_context, int headroom = 0)
      : pool_(pool), vocab_(vocab), max_context_(max_context), headroom_(headroom) {}
  // The input's checks, and its blocks against what the inputs admitted
  // before it left free; admitted, it counts against the next.
  Admission admit(const SeqInput& in);
  // Every check but the blocks; `net_blocks` receives what it would take
  // (negative when a restart gives back more than it needs).
  Admission check(const SeqInput& in, int* net_blocks);

 private:
  const KvBlockPool& pool_;
  int vocab_, max_context_, headroom_;
  std::unordered_set<uint64_t> seen_;
  int net_blocks_ = 0;
};

// The checks every engine's step makes before it touches any state: each
// input's, and the whole step's blocks against the free ones and
// `headroom` more (the engines release every restart first,
// KvBlockPool::release_restarts, so a restart's blocks count for the
// inputs before it). The first failure is the error, naming its sequence.
// `net_blocks` (optional) receives the blocks the step takes.
Status check_step_inputs(std::span<const SeqInput> inputs, const KvBlockPool& pool, int vocab, int max_context,
                         int headroom = 0, int* net_blocks = nullptr);

}  // namespace moe
