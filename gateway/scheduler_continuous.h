#pragma once
// The Scheduler the gateway runs: BatchPolicy (gateway/scheduler_policy.h)
// driven over WorkerLinks. One step in flight at a time; the next is planned
// as soon as its reply arrives (or when work arrives while idle). Links are
// in order of preference: the first ready one serves; when it goes down,
// every running sequence is recomputed on whichever link is ready next
// (the same worker restarted, or a fallback), resuming after the tokens its
// observer already has.

#include <cstdint>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include <uv.h>

#include "gateway/expert_prediction.h"
#include "gateway/scheduler.h"
#include "gateway/scheduler_policy.h"
#include "gateway/worker_link.h"
#include "gateway/worker_supervisor.h"

namespace moe::gw {

struct ContinuousSchedulerOptions {
  int max_step_tokens = 256;
  int headroom_blocks = 1;
  bool report_expert_usage = false;
  WorkerLinkOptions link;  // socket_path is taken from the list of workers
  // Expert prediction: each prompt is predicted at submit, its bucket tag
  // travels with its chunks, warm hints precede its first prefill, and the
  // prediction is scored against the usage the worker reports. Null: off.
  PromptExpertPredictor* predictor = nullptr;  // must outlive the scheduler
  bool learn_from_replies = false;  // no Redis: the table learns from this gateway's own replies
  bool warm_hints = true;
  bool grouped_batching = true;
  int grouping_max_skips = 4;
};

class ContinuousScheduler final : public Scheduler {
 public:
  ContinuousScheduler(uv_loop_t* loop, std::vector<std::string> worker_sockets, ContinuousSchedulerOptions opts);
  ~ContinuousScheduler() override;

  // Keeps the supervisor of the worker it serves from alive as long as itself.
  void own_supervisor(std::unique_ptr<WorkerSupervisor> s) { supervisor_ = std::move(s); }
  WorkerSupervisor* supervisor() const { return supervisor_.get(); }

  uint64_t submit(SequenceRequest req, SequenceObserver* obs) override;
  void cancel(uint64_t id) override;
  bool ready() const override;
  SchedulerStats stats() const override;
  int max_context() const override;

  uint64_t steps_sent() const { return steps_sent_; }

 private:
  void on_ready(size_t link, const protocol::Hello& h);
  void on_frame(size_t link, const protocol::Frame& f);
  void on_down(size_t link);
  void request_kick();  // plans on the next loop turn (never inside a caller's call)
  void kick();
  void finish_step(const std::vector<ChunkResult>& results);
  void dispatch(std::vector<SequenceUpdate>& updates);
  WorkerLink* active_link() const;
  void send_releases(std::vector<uint64_t> ids);
  void send_warm_hints(WorkerLink* link, uint64_t seq_id);
  void prediction_done(uint64_t id);  // scores (and maybe learns from) a finished sequence

  uv_loop_t* loop_;
  ContinuousSchedulerOptions opts_;
  std::unique_ptr<WorkerSupervisor> supervisor_;
  std::vector<std::unique_ptr<WorkerLink>> links_;
  int active_ = -1;  // index of the link the policy's state lives on
  BatchPolicy policy_;
  std::unordered_map<uint64_t, SequenceObserver*> observers_;
  uint64_t next_seq_id_ = 1;  // 0 is reserved by the protocol
  bool in_flight_ = false;
  uint64_t in_flight_request_ = 0;
  StepPlan in_flight_plan_;
  uv_timer_t* kick_timer_ = nullptr;
  uint64_t steps_sent_ = 0;
  struct Predicted {
    ExpertPrediction prediction;
    std::vector<float> usage;  // [layer * n_experts + expert]: tokens the worker reported
  };
  std::unordered_map<uint64_t, Predicted> predicted_;
  uint64_t warm_hints_sent_ = 0;
};

}  // namespace moe::gw
