#include "replay/trace_replay.h"

#include "replay/belady_policy.h"

#include <algorithm>

namespace moe {

Result<std::unique_ptr<EvictionPolicy>> make_policy(const std::string& name,
                                                    const RoutingTrace& trace) {
  std::unique_ptr<EvictionPolicy> p;
  if (name == "lru")
    p = std::make_unique<LruPolicy>();
  else if (name == "lfu")
    p = std::make_unique<LfuDecayPolicy>();
  else if (name == "ours")
    p = std::make_unique<OursPolicy>();
  else if (name == "belady")
    p = std::make_unique<BeladyPolicy>(trace.access_sequence());
  else
    return make_error("unknown policy '" + name + "' (lru, lfu, ours, belady)");
  return p;
}

RoutingTrace trace_slice(const RoutingTrace& trace, int64_t first, int64_t count) {
  RoutingTrace out = trace;
  out.steps.clear();
  for (const RoutingStep& s : trace.steps)
    if (s.token >= first && (count < 0 || s.token < first + count)) out.steps.push_back(s);
  return out;
}

Result<ReplayResult> replay_trace(const RoutingTrace& trace, std::unique_ptr<EvictionPolicy> policy,
                                  const ReplayOptions& opt) {
  const int n_experts = std::max(opt.n_experts, trace.n_experts);
  if (opt.slots < trace.top_k)
    return make_error("replay: " + std::to_string(opt.slots) + " islands cannot hold one step's " +
                      std::to_string(trace.top_k) + " experts");
  ReplayResult out;
  out.policy = policy->name() + (opt.predict ? "+prediction" : "");
  // Belady is the bound only when it sees every candidate.
  const int64_t max_scan = policy->name() == "belady" ? 0 : opt.max_scan;
  ResidencyMap map(trace.n_layers, n_experts, opt.slots, opt.expert_bytes, std::move(policy),
                   max_scan);
  ExpertPredictor predictor(trace.n_layers, n_experts, opt.predictor);
  if (const RoutingProfile* p = opt.warm_profile) {
    if (p->n_moe_layers() < trace.n_layers || p->n_experts != n_experts)
      return make_error("replay: the warm profile's " + std::to_string(p->n_moe_layers()) + " layers x " +
                        std::to_string(p->n_experts) + " experts do not cover the trace's " +
                        std::to_string(trace.n_layers) + " x " + std::to_string(n_experts));
    if (opt.seed && p->tokens > 0)
      for (int l = 0; l < trace.n_layers; ++l) map.seed(l, p->rates(l));
    int64_t placed = 0;
    for (const ExpertKey& k : p->warm_order()) {
      if (placed >= opt.slots) break;
      if (k.layer >= trace.n_layers) continue;
      const int e = k.expert;
      placed += int64_t(map.hint(k.layer, std::span<const int>(&e, 1), HintPriority::warm).size());
    }
  }

  for (const RoutingStep& s : trace.steps) {
    for (int e : s.experts) {
      auto r = map.acquire({s.layer, e});
      if (!r) return make_error(r.error());
    }
    map.clear_predictions(s.layer);
    if (opt.predict) {
      predictor.observe(s.layer, s.experts);
      const int next = (s.layer + 1) % trace.n_layers;
      const std::vector<int> guesses = predictor.predict_next(s.layer, s.experts);
      (void)map.hint(next, guesses, HintPriority::prefetch);
    }
    for (int e : s.experts)
      if (auto st = map.unpin({s.layer, e}); !st) return make_error(st.error());
  }
  out.stats = map.stats();
  return out;
}

}  // namespace moe
