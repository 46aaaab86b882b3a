// make_scheduler: the engine side the gateway's main() runs. With --worker
// unix:PATH (repeatable: the workers serve at once) it connects to running
// workers; with only --model it starts and supervises its own moe-worker.
// --fallback-worker serves only while none of the others is ready.
#include "gateway/sched/scheduler_factory.h"

#include <algorithm>
#include <cstdlib>
#include <string>
#include <vector>

#include "gateway/sched/scheduler_continuous.h"
#include "gateway/sched/worker_supervisor.h"

namespace moe::gw {

Result<std::unique_ptr<Scheduler>> make_scheduler(uv_loop_t* loop, const GatewayOptions& opts,
                                                  PromptExpertPredictor* predictor,
                                                  std::function<std::map<std::string, std::string>()> resident_sets,
                                                  WorkerVocabulary vocabulary) {
  ContinuousSchedulerOptions so;
  so.link.vocabulary = std::move(vocabulary);
  // With Redis, workers publish per-request routing summaries from the usage;
  // the predictor scores its predictions against it.
  so.report_expert_usage = !opts.redis_url.empty() || predictor != nullptr;
  so.max_step_tokens = opts.max_step_tokens;
  so.predictor = predictor;
  so.learn_from_replies = opts.redis_url.empty();
  so.grouped_batching = opts.grouped_batching;
  so.grouping_max_skips = opts.grouping_max_skips;
  so.resident_sets = std::move(resident_sets);
  so.stats_interval_ms = opts.stats_interval_ms;
  so.thermal.hot_c = opts.thermal_hot_c;
  so.priority_max_wait_ms = opts.priority_max_wait_ms;
  so.worker_wait_ms = opts.worker_wait_s * 1000;
  std::vector<std::string> sockets;
  for (const std::string& w : opts.workers) {
    if (w.rfind("unix:", 0) != 0) return make_error("--worker needs unix:PATH, got '" + w + "'");
    sockets.push_back(w.substr(5));
  }
  std::unique_ptr<WorkerSupervisor> supervisor;
  if (sockets.empty()) {
    if (opts.model_path.empty()) return make_error("either --worker unix:PATH or --model is needed");
    // MOE_WORKER_BIN names the worker executable where the command line cannot.
    const char* bin_env = std::getenv("MOE_WORKER_BIN");
    auto bin = find_worker_binary(bin_env ? bin_env : "");
    if (!bin.ok()) return make_error(bin.error());
    SupervisorOptions sup;
    sup.worker_bin = bin.value();
    sup.model_path = opts.model_path;
    sup.extra_args = opts.worker_args;
    // The gateway's Redis is its own worker's too (re-warm, routing
    // summaries), unless the worker's arguments name one.
    const bool names_redis = std::any_of(opts.worker_args.begin(), opts.worker_args.end(), [](const std::string& a) {
      return a == "--redis" || a.rfind("--redis=", 0) == 0;
    });
    if (!opts.redis_url.empty() && !names_redis) {
      sup.extra_args.insert(sup.extra_args.end(), {"--redis", opts.redis_url});
      if (!opts.redis_password_file.empty())
        sup.extra_args.insert(sup.extra_args.end(), {"--redis-password-file", opts.redis_password_file});
    }
    auto s = WorkerSupervisor::start(loop, sup);
    if (!s.ok()) return make_error(s.error());
    supervisor = std::move(s.value());
    sockets.push_back(supervisor->socket_path());
  }
  // The fallback is the least preferred link: served only while the others are down.
  if (!opts.fallback_worker.empty()) {
    sockets.push_back(opts.fallback_worker.substr(5));
    so.last_is_fallback = true;
  }
  auto sched = std::make_unique<ContinuousScheduler>(loop, std::move(sockets), so);
  if (supervisor) sched->own_supervisor(std::move(supervisor));
  return std::unique_ptr<Scheduler>(std::move(sched));
}

}  // namespace moe::gw
