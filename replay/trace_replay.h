#pragma once
// Replays a routing trace through the real ResidencyMap with a chosen
// eviction policy, optionally with the online next-layer predictor hinting
// one layer ahead, and reports the map's counters. Used by
// `moe replay-trace` and the residency tests.

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "residency/eviction_policy.h"
#include "residency/expert_predictor.h"
#include "residency/residency.h"
#include "residency/routing_profile.h"
#include "replay/routing_trace.h"
#include "model/result.h"

namespace moe {

struct ReplayOptions {
  int64_t slots = 0;        // islands, across all layers
  size_t expert_bytes = 0;  // one expert blob, for the byte counter
  int n_experts = 0;        // experts per layer; 0: the trace's
  bool predict = false;     // hint the predictor's guesses one layer ahead
  int64_t max_scan =
      ResidencyMap::kDefaultMaxScan;  // as the worker runs it; belady always scans all
  PredictorParams predictor;
  // Before the first step: the policy's prior from this profile (with
  // `seed`) and its most used experts warmed into the free islands, as
  // `moe-worker --warm-profile` starts (residency/routing_profile.h).
  const RoutingProfile* warm_profile = nullptr;
  bool seed = true;
};

struct ReplayResult {
  std::string policy;  // "lru", ..., "ours+prediction"
  ResidencyStats stats;
};

// The policy names replay knows: lru, lfu, ours, belady. Belady reads the
// trace's future; the others only see it as it happens.
[[nodiscard]] Result<std::unique_ptr<EvictionPolicy>> make_policy(const std::string& name,
                                                                  const RoutingTrace& trace);

// The steps of tokens [first, first + count) (count < 0: to the end), in order.
RoutingTrace trace_slice(const RoutingTrace& trace, int64_t first, int64_t count);

// Each step: acquire the step's experts (pinned), drop the layer's unused
// predictions, hint the next layer's guesses (with `predict`), unpin.
[[nodiscard]] Result<ReplayResult> replay_trace(const RoutingTrace& trace,
                                                std::unique_ptr<EvictionPolicy> policy,
                                                const ReplayOptions& opt);

}  // namespace moe
