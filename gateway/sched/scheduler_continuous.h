#pragma once
// The Scheduler the gateway runs: one BatchPolicy (gateway/scheduler_policy.h)
// per worker, driven over WorkerLinks, one step in flight per worker; the
// next is planned as soon as its reply arrives (or when work arrives while
// idle).
//
// Several workers (one per GPU) serve at once. A submitted sequence waits in
// a shared queue until some worker is ready; then it goes to the worker whose
// resident experts best cover its predicted experts, weighed against the
// worker's load (gateway/worker_choice.h; without predictions or resident
// sets the lighter worker wins) and stays there, unless it is still waiting
// for admission when another worker runs out of work: an idle worker takes
// the younger half of the busiest worker's queue. The fallback worker serves
// only while none of the others is ready. When a worker goes down, every
// sequence it held goes back to the front of the shared queue and is
// recomputed on another (the same restarted, the others, or the fallback),
// resuming after the tokens its observer already has; when a main worker is
// ready again, the fallback's sequences move back the same way — except
// those sent to the fallback by overload (SequenceRequest::on_fallback),
// which stay there to their end (docs/operations.md).

#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include <uv.h>

#include "gateway/observe/expert_view.h"
#include "gateway/predict/expert_prediction.h"
#include "gateway/sched/scheduler.h"
#include "gateway/sched/scheduler_policy.h"
#include "gateway/sched/thermal_governor.h"
#include "gateway/sched/worker_choice.h"
#include "gateway/sched/worker_link.h"
#include "gateway/sched/worker_supervisor.h"

namespace moe::gw {

struct ContinuousSchedulerOptions {
  int max_step_tokens = 256;
  int headroom_blocks = 1;
  bool report_expert_usage = false;
  WorkerLinkOptions link;  // socket_path is taken from the list of workers
  // The last worker of the list is a fallback (served only while no other is ready).
  bool last_is_fallback = false;
  // Expert prediction: each prompt is predicted at submit, its bucket tag
  // travels with its chunks, warm hints precede its first prefill, and the
  // prediction is scored against the usage the worker reports. Null: off.
  PromptExpertPredictor* predictor = nullptr;  // must outlive the scheduler
  bool learn_from_replies = false;  // no Redis: the table learns from this gateway's own replies
  bool warm_hints = true;
  bool grouped_batching = true;
  int grouping_max_skips = 4;
  // Worker name (its socket file's stem, as it names itself in Redis) → its
  // resident set text; read when a sequence is given to a worker. May be unset.
  std::function<std::map<std::string, std::string>()> resident_sets;
  WorkerChoiceParams choice;
  // Operations (docs/operations.md): each ready worker is asked for its
  // stats (residency, the card's health) this often (0: never); a hot card
  // halves its worker's step budget and batch.
  uint64_t stats_interval_ms = 1000;
  ThermalLimits thermal;
  uint64_t priority_max_wait_ms = 30'000;  // PolicyLimits
  // How long no worker may be ready (all lost, or none reached since the
  // start) before the gateway counts as failing: what waits for a worker
  // ends with the reason, new requests are refused, as when its own worker
  // cannot start. Workers started elsewhere have no exits to count; this
  // bounds their absence. 0: wait for ever.
  uint64_t worker_wait_ms = 120'000;
};

class ContinuousScheduler final : public Scheduler {
 public:
  ContinuousScheduler(uv_loop_t* loop, std::vector<std::string> worker_sockets, ContinuousSchedulerOptions opts);
  ~ContinuousScheduler() override;

  // Keeps the supervisor of the worker it serves from alive as long as itself.
  void own_supervisor(std::unique_ptr<WorkerSupervisor> s);
  WorkerSupervisor* supervisor() const { return supervisor_.get(); }

  uint64_t submit(SequenceRequest req, SequenceObserver* obs) override;
  void cancel(uint64_t id) override;
  bool ready() const override;
  SchedulerStats stats() const override;
  int max_context() const override;
  int kv_capacity() const override;
  std::string backend() const override;
  std::string failing() const override;
  OverloadView overload(int priority) const override;
  ExpertView* expert_view() override { return &expert_view_; }

  uint64_t steps_sent() const;
  // Per worker, in the order given (tests, logs).
  uint64_t steps_sent(size_t worker) const { return workers_[worker].steps_sent; }
  uint64_t sequences_assigned(size_t worker) const { return workers_[worker].assigned; }
  uint64_t sequences_taken_over(size_t worker) const { return workers_[worker].taken_over; }
  size_t workers() const { return workers_.size(); }
  bool worker_ready(size_t worker) const { return workers_[worker].link->ready(); }
  const std::string& worker_refused(size_t worker) const { return workers_[worker].link->refused(); }

 private:
  struct Worker {
    std::unique_ptr<WorkerLink> link;
    std::string name;  // the socket file's stem
    bool fallback = false;
    BatchPolicy policy;
    bool in_flight = false;
    uint64_t in_flight_request = 0;
    StepPlan in_flight_plan;
    uint64_t steps_sent = 0;
    uint64_t assigned = 0;
    uint64_t taken_over = 0;  // sequences moved here from another worker's queue
    // The worker's last pressure: 0 none, 1 warn, 2 evict. Under pressure it
    // is given no new sequences; a step reply with 20 % of its KV free (or
    // an empty queue) clears it.
    int pressure = 0;
    // Its limits as its hello set them, before the thermal governor's cut.
    PolicyLimits base_limits;
    ThermalGovernor thermal;
    bool have_stats = false;
    protocol::StatsReply stats;  // its last stats reply
  };

  // The policy's limits from the worker's base ones and its card's state.
  void apply_limits(size_t w);
  void poll_stats();  // the stats timer
  void on_stats(size_t w, const protocol::StatsReply& r);
  // Ready, and holding sequences that ride on it by overload (the fallback):
  // it steps even while a main worker serves.
  bool stepping(size_t w) const;

  void on_ready(size_t w, const protocol::Hello& h);
  void on_frame(size_t w, const protocol::Frame& f);
  void on_down(size_t w, bool unresponsive);
  void request_kick();  // plans on the next loop turn (never inside a caller's call)
  void kick();
  void assign_queued();
  // Gives the queued sequence at `it` to worker `w`; the next queued one.
  std::deque<SequenceState>::iterator give(size_t w, std::deque<SequenceState>::iterator it);
  void rebalance();  // an idle worker takes half the queue of the busiest one (what it can hold)
  // A main worker outside `candidates` (the workers taking sequences now)
  // may hold `s` once it takes them again.
  bool may_fit_later(const SequenceState& s, const std::vector<size_t>& candidates, bool whole) const;
  void step(size_t w);
  void finish_step(size_t w, const std::vector<ChunkResult>& results);
  void dispatch(std::vector<SequenceUpdate>& updates);
  void requeue(std::vector<SequenceState> seqs);  // at the front of the shared queue, in order
  void end_waiting(const std::string& why);  // every sequence waiting for a worker ends with `why`
  // The last ready worker is gone (or none was ever ready): the clock of
  // worker_wait_ms starts.
  void none_ready();
  void none_ready_too_long();  // the wait timer
  // Why no worker has been ready for worker_wait_ms or longer, in a
  // sentence naming each worker's last failure; empty before the bound.
  std::string no_worker_reason() const;
  bool serving(size_t w) const;  // ready, and allowed to take sequences now
  void send_releases(size_t w, std::vector<uint64_t> ids);
  void send_warm_hints(WorkerLink* link, uint64_t seq_id);
  void prediction_done(uint64_t id);  // scores (and maybe learns from) a finished sequence

  uv_loop_t* loop_;
  ContinuousSchedulerOptions opts_;
  std::unique_ptr<WorkerSupervisor> supervisor_;
  std::vector<Worker> workers_;
  std::deque<SequenceState> queued_;               // submitted or moved, not yet given to a worker
  std::unordered_map<uint64_t, size_t> owner_;     // sequence → the worker whose policy holds it
  std::unordered_set<uint64_t> moved_;             // queued after running on a worker: they go first
  std::unordered_map<uint64_t, SequenceObserver*> observers_;
  uint64_t next_seq_id_ = 1;  // 0 is reserved by the protocol
  uv_timer_t* kick_timer_ = nullptr;
  uv_timer_t* stats_timer_ = nullptr;
  uv_timer_t* wait_timer_ = nullptr;  // fires worker_wait_ms after none_ready()
  uint64_t none_ready_since_ms_ = 0;  // 0: some worker is ready
  struct Predicted {
    ExpertPrediction prediction;
    std::vector<float> usage;  // [layer * n_experts + expert]: tokens the worker reported
  };
  std::unordered_map<uint64_t, Predicted> predicted_;
  uint64_t warm_hints_sent_ = 0;
  uint64_t steps_with_usage_ = 0;
  uint64_t step_experts_ = 0;
  uint64_t worker_expert_hits_ = 0, worker_expert_misses_ = 0;
  uint64_t pressure_frames_[3] = {0, 0, 0};  // warn, evict, break frames received
  ExpertView expert_view_;
};

}  // namespace moe::gw
