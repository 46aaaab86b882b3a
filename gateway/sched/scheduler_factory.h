#pragma once
// The construction point of the engine side. The gateway's main() builds the
// Scheduler here from the command line (workers, Redis, model); its
// definition lives in gateway/scheduler_factory.cpp with the scheduler.

#include <functional>
#include <map>
#include <memory>
#include <string>

#include <uv.h>

#include "gateway/predict/expert_prediction.h"
#include "gateway/gateway_options.h"
#include "gateway/sched/scheduler.h"
#include "gateway/sched/worker_link.h"
#include "model/result.h"

namespace moe::gw {

// A Scheduler running on `loop` (connecting to opts.workers); an error when
// it cannot be set up. The loop must outlive it, and so must `predictor`
// (null: no expert prediction).
// `resident_sets` (optional) gives each worker's published resident experts
// by worker name, for choosing among several workers. `vocabulary`: what
// every worker's hello must say of its model's token ids (the gateway's own
// model's; empty: not checked), or the worker is refused.
Result<std::unique_ptr<Scheduler>> make_scheduler(
    uv_loop_t* loop, const GatewayOptions& opts, PromptExpertPredictor* predictor = nullptr,
    std::function<std::map<std::string, std::string>()> resident_sets = {}, WorkerVocabulary vocabulary = {});

}  // namespace moe::gw
