#pragma once
// A routing trace: which experts each token used at each MoE layer, in the
// order a decode step visits them (token by token, layer by layer). The
// residency replay (replay/trace_replay.h) and the tests run it through
// the real residency map. Formats (docs/memory-islands.md):
//  - JSON lines: one object per line {"token": t, "layer": l, "experts": [...]}
//  - a .safetensors file holding an integer tensor [layers, tokens, top_k]
//    (the demo model's reference.safetensors: `eval.routing_topk`, I16).

#include <cstdint>
#include <string>
#include <vector>

#include "residency/eviction_policy.h"
#include "model/result.h"

namespace moe {

struct RoutingStep {
  int64_t token = 0;
  int layer = 0;
  std::vector<int> experts;  // [top_k] routed experts of this token at this layer
};

struct RoutingTrace {
  int n_layers = 0;                // 1 + the largest layer seen
  int n_experts = 0;               // 1 + the largest expert seen
  int top_k = 0;                   // the largest expert count of a step
  std::vector<RoutingStep> steps;  // in visiting order

  // The acquires a replay makes, in order (Belady's future knowledge).
  std::vector<ExpertKey> access_sequence() const;
};

// JSON-lines text. Blank lines are skipped; a bad line is an error naming it.
[[nodiscard]] Result<RoutingTrace> parse_routing_jsonl(const std::string& text);
// Reads a JSON-lines file, or a .safetensors file's `tensor` [layers, tokens, k]
// (I16/I32/I64), ordered token-major.
[[nodiscard]] Result<RoutingTrace> read_routing_trace(
    const std::string& path, const std::string& tensor = "eval.routing_topk");
// Steps from a [layers, tokens, k] array of expert ids, token-major.
RoutingTrace trace_from_topk(const std::vector<int>& topk, int n_layers, int64_t n_tokens,
                             int top_k);

}  // namespace moe
