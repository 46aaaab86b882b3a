#pragma once
// The continuous-batching policy, without sockets: it decides what the next
// worker step holds and folds the step's results back into the sequences.
//
// Every step carries each decoding sequence's one new token, then prefill
// chunks (oldest first) up to the per-step token budget. A waiting request is
// admitted only when the worker's KV blocks hold its whole prompt plus
// headroom next to what the admitted sequences will need. When a decode step
// would run out of blocks, the youngest sequence is preempted: released on
// the worker and put back at the front of the queue, to be recomputed later
// by prefilling its prompt plus the tokens it already produced (those tokens
// are never reported twice). A lost worker preempts everything the same way.
//
// Admission is round-robin across requests (SequenceRequest::group): the
// next sequence admitted is the oldest waiting one of the request admitted
// least recently, so a request of 128 choices does not hold back one that
// came after it. Sequences put back at the front (preempted, or moved from a
// lost worker) go before all of these.
//
// Priorities (docs/operations.md) come before all of that: waiting sequences
// are considered by class (SequenceRequest::priority, lower first; one
// submitted priority_max_wait_ms ago or more counts as the most urgent), the
// order above holding within a class; a waiting sequence that does not fit
// preempts running ones of a later class when that makes room, and the
// victim of a decode short of blocks is the latest class's youngest.
//
// Expert-grouped batching (docs/expert-prediction.md): when more prefill
// chunks or waiting requests compete for a step than its budget takes, the
// ones whose predicted experts overlap most with what the step already uses
// go first, so one expert's weights serve several sequences. A sequence that
// has been passed over `grouping_max_skips` times goes next regardless, so
// none starves; sequences without a prediction keep first-come order.

#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <unordered_map>
#include <string>
#include <vector>

#include "gateway/predict/expert_set.h"
#include "gateway/sched/scheduler.h"
#include "gateway/sched/token_controls.h"

namespace moe::gw {

struct PolicyLimits {
  int max_step_tokens = 256;  // tokens of one step, decode and prefill together
  int kv_blocks_total = 0;    // as the worker reported
  int kv_block_tokens = 16;
  int max_context = 0;        // prompt + generated, per sequence
  int headroom_blocks = 1;    // kept free per admission for the first decodes
  int max_batch_sequences = 4096;
  bool grouped_batching = true;  // choose by predicted-expert overlap (else first come first served)
  int grouping_max_skips = 4;    // times a sequence may be passed over before it goes next
  int grouping_window = 16;      // waiting requests considered for admission at once
  // Priorities (docs/operations.md): a sequence submitted this long ago or
  // more counts as the most urgent class (0: never).
  uint64_t priority_max_wait_ms = 30'000;
};

// What the gateway predicted for a sequence (expert_prediction.h).
struct SequenceHints {
  ExpertSet experts;        // predicted (layer, expert) pairs; empty: no prediction
  uint64_t route_tag = 0;   // StepSequence.route_bucket
};

// One sequence's part of a step.
struct PlannedChunk {
  uint64_t seq_id = 0;
  std::vector<int32_t> tokens;
  int start_pos = 0;
  bool sample = false;  // the last prefill chunk or a decode token
  Sampling sampling;    // the request's, sent with every chunk
  uint64_t route_tag = 0;
};

struct StepPlan {
  std::vector<PlannedChunk> chunks;     // the step (empty: nothing to run)
  std::vector<uint64_t> release;        // free these on the worker before the step
  bool empty() const { return chunks.empty() && release.empty(); }
};

// What the worker answered for one chunk.
struct ChunkResult {
  uint64_t seq_id = 0;
  bool ok = true;
  std::string error;
  bool sampled = false;
  TokenEvent token;
  int cached_tokens = 0;  // prompt tokens the prefix cache served (a chunk from position 0)
};

// A sequence outside any worker's policy (moved between workers): what it
// asked for and the tokens already reported to its observer.
struct SequenceState {
  uint64_t id = 0;
  SequenceRequest req;
  std::vector<int32_t> generated;
  SequenceHints hints;
};

// What observers must hear after a step, in order.
struct SequenceUpdate {
  uint64_t seq_id = 0;
  std::vector<TokenEvent> tokens;  // new tokens (at most one per step)
  bool finished = false;
  FinishReason reason = FinishReason::length;
  std::string error;
};

class BatchPolicy {
 public:
  explicit BatchPolicy(PolicyLimits limits = {}) : limits_(limits) {}

  void set_limits(const PolicyLimits& limits) { limits_ = limits; }
  const PolicyLimits& limits() const { return limits_; }

  // Queues a request at the back. A request that can never run (empty, longer
  // than the context or the whole KV cache) finishes at the next plan() with
  // an error update instead.
  void add(uint64_t id, SequenceRequest req, SequenceHints hints = {});
  // Forgets a sequence; true when the worker holds KV for it (send a release).
  bool cancel(uint64_t id);

  // The next step. Requests that can never run are reported in `rejected`.
  // `now_ms` (the clock of SequenceRequest::submitted_ms) ages priorities.
  StepPlan plan(std::vector<SequenceUpdate>* rejected = nullptr, uint64_t now_ms = 0);
  // Folds the worker's answers to `plan` back in (results of cancelled
  // sequences are ignored). Finished sequences are forgotten; their ids are
  // added to `release_after` so their KV is freed.
  std::vector<SequenceUpdate> apply(const StepPlan& plan, const std::vector<ChunkResult>& results,
                                    std::vector<uint64_t>* release_after);
  // The worker lost its state (crash, reconnect): every admitted sequence
  // goes back to the front of the queue, in admission order, to be
  // recomputed from prompt + generated tokens.
  void worker_lost();
  // Removes every sequence, admitted ones first (admission order), then the
  // queue in order. The caller releases the admitted ones on the worker if it
  // still holds their KV (running_ids() before the call).
  std::vector<SequenceState> take_all();
  // Removes the sequences `which` selects (admitted ones first, then the
  // queue, each in order); the ids of the admitted ones, whose KV the worker
  // holds, go to `released`.
  std::vector<SequenceState> take_if(const std::function<bool(const SequenceRequest&)>& which,
                                     std::vector<uint64_t>* released);
  // Removes up to `n` sequences from the back of the queue (the youngest; none
  // holds KV on the worker) that `which` takes (null: any), oldest of them first.
  std::vector<SequenceState> take_waiting(size_t n, const std::function<bool(const SequenceState&)>& which = {});
  // Whether this worker can hold the sequence's whole context (what it has
  // generated too) and sample its next token: where it may be sent.
  bool fits(const SequenceState& s) const;
  // ... and all it may generate (max_new_tokens, within the context): it
  // will not end early here for want of KV.
  bool holds_all(const SequenceState& s) const;
  // Queues a sequence moved from another worker: it is recomputed from its
  // prompt plus `generated`, whose tokens are not reported again.
  void add_resumed(SequenceState s, bool front);
  // KV blocks the admitted sequences will hold plus those the queue's
  // prompts need: the worker's load as this policy sees it.
  int demand_blocks() const;
  // Waiting sequences of `priority` or an earlier one: how many, and the
  // earliest SequenceRequest::waiting_since_ms among them (0: none).
  void waiting_at_or_before(int priority, int* count, uint64_t* oldest_since) const;
  // Sequences here that ride on the fallback by overload.
  int on_fallback() const;
  // The latest (numerically largest) priority among the sequences here
  // (INT_MIN when none).
  int latest_priority() const;
  uint64_t priority_preemptions() const { return priority_preemptions_; }
  uint64_t fairness_preemptions() const { return fairness_preemptions_; }

  // Observation (tests, stats).
  int waiting() const { return int(waiting_.size()); }
  int running() const { return int(running_.size()); }
  int kv_blocks_used() const;  // blocks the admitted sequences hold on the worker
  uint64_t preemptions() const { return preemptions_; }
  std::vector<uint64_t> waiting_ids() const { return {waiting_.begin(), waiting_.end()}; }
  std::vector<uint64_t> running_ids() const;  // in admission order
  const std::vector<int32_t>* generated(uint64_t id) const;
  bool knows(uint64_t id) const { return seqs_.count(id) != 0; }
  int skips(uint64_t id) const;  // times passed over by grouped batching since last chosen

 private:
  struct Seq {
    SequenceRequest req;
    std::vector<int32_t> generated;  // reported to the observer already
    std::vector<int32_t> context;    // prompt + generated, what the worker must hold
    int on_worker = 0;               // tokens of `context` the worker holds
    uint64_t admitted_at = 0;        // admission order (youngest = largest)
    bool admitted = false;
    SequenceHints hints;
    int skips = 0;                   // passed over by grouped batching
    bool front = false;              // put back at the front: admitted before the round-robin
    TokenControls controls;          // what each sampled chunk's adjustment list is made of
    int cached_tokens = 0;           // of its last fresh start, what the prefix cache served
  };
  // Up to `limit` waiting sequences as positions in waiting_, in the order
  // admission considers them: those put back at the front, then round-robin
  // across groups (the group admitted least recently first).
  std::vector<size_t> admission_order(size_t limit) const;
  // The same, priorities aside: the callers holding fewer running sequences
  // first (fair shares), then admission_order_fifo.
  std::vector<size_t> admission_order_within(size_t limit) const;
  // Those put back at the front, then round-robin across groups.
  std::vector<size_t> admission_order_fifo(size_t limit) const;
  using CallerCounts = std::unordered_map<uint64_t, int>;  // caller -> running sequences
  CallerCounts running_by_caller() const;
  void count_group(uint64_t group, int delta);
  // Grouped batching: which of `candidates` (oldest first) goes next.
  size_t pick_grouped(const std::vector<uint64_t>& candidates, const ExpertSet& step) const;
  int blocks_for(int tokens) const;
  // Why a context of `len` tokens can never run on this worker (the context
  // must leave room for one more token, its KV fit the whole cache), or "".
  std::string context_problem(int len) const;
  void drop_unsendable(StepPlan& plan, std::vector<SequenceUpdate>* rejected);
  int committed_blocks() const;  // blocks admitted sequences hold or will hold once prefilled
  // `front`: it goes before the round-robin when it waits again (a
  // preemption for its caller's fair share does not: it waits at the back
  // of the queue, its turn among the requests by the round-robin).
  void preempt(uint64_t id, StepPlan& plan, bool front = true);
  // Priorities: a sequence's class now (lower first; aged: the most urgent).
  int64_t effective_priority(const Seq& s) const;
  // The running sequence to preempt first, among those `eligible` takes:
  // the latest class, then the caller holding the most (`held`), then the
  // youngest.
  uint64_t victim(const std::function<bool(const Seq&)>& eligible,
                  const CallerCounts& held) const;  // 0: none eligible (null: any)
  // Its prompt is on the worker: the next step carries its one decode token.
  static bool decoding(const Seq& s) { return int(s.context.size()) - s.on_worker == 1; }
  // Frees room for the first waiting sequence by preempting running ones of
  // a later class, when that is enough for it to fit.
  void preempt_for_priority(StepPlan& plan);
  // Fair shares: frees room for the first waiting sequence (of the same
  // class) by preempting running ones of callers that hold more than one
  // sequence more of the batch than its caller, while that is so.
  void preempt_for_fairness(StepPlan& plan);
  // Preempts `eligible` running sequences (victim() order) until `want`
  // fits with `first_chunk` step tokens, only when that is enough; how many
  // were preempted. `eligible` sees the callers' running counts as if the
  // victims chosen so far were gone.
  int make_room(const Seq& want, int first_chunk, const std::function<bool(const Seq&, const CallerCounts&)>& eligible,
                bool front, StepPlan& plan);
  bool can_ever_run(const Seq& s, std::string* why) const;

  PolicyLimits limits_;
  std::map<uint64_t, Seq> seqs_;
  std::deque<uint64_t> waiting_;
  std::vector<uint64_t> running_;  // admission order
  uint64_t admit_counter_ = 0;
  uint64_t preemptions_ = 0;
  uint64_t priority_preemptions_ = 0;
  uint64_t fairness_preemptions_ = 0;
  uint64_t now_ms_ = 0;  // the last plan()'s clock
  struct Group {
    int sequences = 0;       // waiting or running
    uint64_t admitted = 0;   // admit_counter_ at its last admission (0: never)
  };
  std::unordered_map<uint64_t, Group> groups_;
};

}  // namespace moe::gw
