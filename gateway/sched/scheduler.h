#pragma once
// The seam between the OpenAI layer (requests, text, HTTP) and the engine
// side (sequences, batches, workers). The OpenAI layer turns one request into
// one sequence per choice, owns detokenisation and stop strings, and calls
// cancel() when a stop string matched or the client went away. The scheduler
// batches every running sequence into worker steps (continuous batching,
// chunked prefill, KV admission, preemption) and reports tokens back.
//
// Threading: everything here runs on the gateway's libuv loop thread only;
// observers are called on that thread.

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "gateway/structured/token_grammar.h"
#include "protocol/messages.h"

namespace moe::gw {

class ExpertView;

// A request's sampling, in the form the step frame carries it (validated
// and clamped where the request is read, gateway/completion_request.cpp).
using Sampling = protocol::SamplingParams;

struct SequenceRequest {
  std::vector<int32_t> prompt;    // token ids, template applied
  int max_new_tokens = 16;
  Sampling sampling;
  std::vector<int32_t> stop_ids;  // generation ends after emitting one of these (EOS)
  // Token controls (docs/sampling.md; the penalties and min_p are in
  // `sampling`): biases by token id (sorted, distinct), and how many tokens
  // come before a stop id may (the stop ids are banned until then).
  std::vector<std::pair<int32_t, float>> logit_bias;
  int min_tokens = 0;
  // Structured output (docs/structured-output.md): each sampled chunk
  // carries the tokens the grammar allows next; null: unconstrained.
  std::shared_ptr<const structured::TokenGrammar> grammar;
  // The request it belongs to (its choices share it): waiting sequences are
  // admitted round-robin across groups, so a request of many choices cannot
  // hold back the requests that came after it.
  uint64_t group = 0;
  // Lower runs first (docs/operations.md, "Priorities"); 0 the default.
  int priority = 0;
  // Who sent it (a digest of the caller's key or address; 0: unknown). A
  // caller's waiting sequence that finds no room preempts running ones of a
  // caller holding more of the batch than it does (docs/scheduler.md, "Fair
  // shares"): one client's 256 choices do not hold every other client out.
  uint64_t caller = 0;
  // Served by the fallback worker to its end (overload, docs/operations.md);
  // unset again if the fallback is lost under it.
  bool on_fallback = false;
  // When the scheduler took it (uv_now, ms): the starvation bound. Set by submit().
  uint64_t submitted_ms = 0;
  // When it last began to wait (submitted, preempted, moved from a lost
  // worker): the overload rule's oldest wait.
  uint64_t waiting_since_ms = 0;
};

// What the overload rule reads for a new request of one priority
// (docs/operations.md): the sequences waiting for a main worker that would
// go before it (its priority or an earlier one), the longest of their
// current waits, and whether the fallback could take it.
struct OverloadView {
  int waiting = 0;
  uint64_t oldest_wait_ms = 0;
  bool fallback_ready = false;
  int fallback_max_context = 0;  // tokens a sequence may have there
};

struct TokenEvent {
  int32_t token = 0;
  float logprob = 0.0f;                           // when requested
  std::vector<std::pair<int32_t, float>> top;     // when requested
  int cached_prompt_tokens = 0;  // the first token's: prompt tokens the worker's prefix cache served
};

enum class FinishReason { stop, length, cancelled, error };

class SequenceObserver {
 public:
  virtual ~SequenceObserver() = default;
  // A newly generated token, in order, never repeated (also across preemption
  // and worker failover: the scheduler resumes from what it already reported).
  virtual void on_token(const TokenEvent& ev) = 0;
  // The sequence ended (EOS => stop, max_new_tokens => length). Final call.
  virtual void on_finished(FinishReason reason, const std::string& error_message) = 0;
};

// One worker as the scheduler sees it (several serve at once).
struct WorkerStats {
  std::string name;         // its socket file's stem
  bool ready = false;
  bool fallback = false;
  int running = 0;          // sequences admitted there
  int waiting = 0;          // given to it, not yet admitted
  uint64_t assigned = 0;    // sequences ever given to it
  uint64_t steps = 0;       // steps sent to it
  // Its last stats reply (residency counters, the card's health), when one came.
  bool have_stats = false;
  protocol::StatsReply stats;
  // The thermal governor (docs/operations.md): hot halves these two.
  bool hot = false;
  int step_token_budget = 0;
  int batch_limit = 0;
};

struct SchedulerStats {
  int waiting = 0;        // submitted, not yet admitted
  int running = 0;        // admitted (prefilling or decoding)
  int kv_blocks_used = 0;
  int kv_blocks_total = 0;
  uint64_t preemptions = 0;
  uint64_t priority_preemptions = 0;  // of those, to make room for an earlier priority
  uint64_t fairness_preemptions = 0;  // of those, for a caller's fair share of the batch
  bool degraded = false;  // serving from the fallback worker
  // What the overload rule reads (docs/operations.md, "Overload"): sequences
  // waiting for a main worker, and how long the oldest of them has waited.
  int main_waiting = 0;
  uint64_t main_oldest_wait_ms = 0;
  int on_fallback = 0;          // sequences the fallback serves by overload
  // Expert prediction (docs/expert-prediction.md); zeros while --predict off.
  bool predicting = false;
  uint64_t prediction_requests = 0;    // finished requests whose prediction was checked
  uint64_t predicted_experts = 0;      // experts predicted for them
  uint64_t prediction_hits = 0;        // of those, used by the request
  uint64_t prediction_buckets = 0;     // LSH buckets the table knows
  uint64_t routing_summaries_learned = 0;
  uint64_t routing_summaries_foreign = 0;  // other LSH settings, or no bucket
  uint64_t warm_hints_sent = 0;        // warm_hints frames sent before prefills
  uint64_t steps_with_usage = 0;       // step replies that carried expert usage
  uint64_t step_experts = 0;           // distinct (layer, expert) pairs those steps used, summed
  uint64_t worker_expert_hits = 0;     // step replies' expert_hits, summed (experts found resident)
  uint64_t worker_expert_misses = 0;   // step replies' expert_misses, summed (experts copied in)
  uint64_t worker_pressure[3] = {0, 0, 0};  // pressure frames received: warn, evict, break
  std::vector<WorkerStats> workers;    // per worker, in the order configured (may be empty)
};

class Scheduler {
 public:
  virtual ~Scheduler() = default;
  // Queues a sequence; returns its id. `obs` must outlive the sequence (until
  // on_finished, or until cancel() returns).
  virtual uint64_t submit(SequenceRequest req, SequenceObserver* obs) = 0;
  // Ends a sequence at once and frees its KV; no observer call follows.
  virtual void cancel(uint64_t id) = 0;
  // True once a worker has said hello and can take steps.
  virtual bool ready() const = 0;
  virtual SchedulerStats stats() const = 0;
  // Tokens of the longest sequence the worker accepts (prompt + generated).
  virtual int max_context() const = 0;
  // Tokens the largest serving worker's whole KV cache holds (0: unknown):
  // a longer prompt can run nowhere now; a sequence that grows past it ends
  // with "length".
  virtual int kv_capacity() const { return 0; }
  // The backend of the worker that serves now ("cpu", "cuda"; "" while none).
  virtual std::string backend() const { return ""; }
  // Non-empty while no worker is ready and none is expected to be (the
  // gateway's own worker keeps failing before it is ready, or no worker has
  // been ready for --worker-wait-s): why, in a sentence. What waited for a
  // worker has ended with it.
  virtual std::string failing() const { return ""; }
  // The overload rule's view for a request of `priority`.
  virtual OverloadView overload(int /*priority*/) const { return {}; }
  // What the /experts page shows (gateway/observe/expert_view.h); null
  // where the scheduler keeps none.
  virtual ExpertView* expert_view() { return nullptr; }
};

}  // namespace moe::gw
