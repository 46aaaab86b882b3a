#pragma once
// A routing profile: how many tokens each expert of each MoE layer served
// over some stretch of real traffic (or a recorded trace). A worker started
// with `--warm-profile FILE` fills its free islands with the profile's most
// used experts before its first step, so the first requests after a start
// or restart do not pay a miss for every hot expert; `--save-profile FILE`
// keeps the worker's own counts in such a file (docs/memory-islands.md,
// "Warm profiles"). `moe profile` makes one from a routing trace or from
// the routing summaries in Redis.
//
// The file is JSON:
//   {"format": "moe-routing-profile", "version": 1,
//    "model": "<model id>", "architecture": "qwen3_moe",
//    "n_experts": 32, "top_k": 4, "tokens": 12345, "source": "<free text>",
//    "layers": [{"layer": <model layer index>, "counts": [<n_experts ints>]}, ...]}
// one entry per MoE layer, in model order.

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "model/model_config.h"
#include "model/result.h"
#include "residency/eviction_policy.h"

namespace moe {

struct RoutingProfile {
  std::string model;         // the model id it was taken on (informative)
  std::string architecture;  // model_type (informative)
  int n_experts = 0;
  int top_k = 0;
  uint64_t tokens = 0;             // tokens counted (each served top_k experts per MoE layer)
  std::string source;              // where the counts come from
  std::vector<int> model_layers;   // per MoE layer: its index among all layers
  std::vector<uint64_t> counts;    // [moe layer * n_experts + expert]: tokens served

  int n_moe_layers() const { return int(model_layers.size()); }
  uint64_t count(int moe_layer, int expert) const { return counts[size_t(moe_layer) * size_t(n_experts) + size_t(expert)]; }

  // An empty profile of a routing shape: the model layer index of each MoE
  // layer, the experts of each.
  static RoutingProfile shaped(std::vector<int> model_layers, int n_experts, int top_k);
  // An empty profile of a model's shape.
  static RoutingProfile for_model(const ModelDesc& desc, std::string model_id);

  // Adds tokens-served counts, [moe layer * n_experts + expert] (a step's
  // expert usage); `tokens` is how many tokens they cover.
  void add(std::span<const uint64_t> usage, uint64_t tokens);

  // "" when this profile was taken on a model of that routing shape (the
  // same MoE layers, the same number of experts), else why not.
  std::string mismatch(const std::vector<int>& model_layers, int n_experts) const;

  // Each expert's share of the tokens at a MoE layer, in [0, 1] (all 0 when
  // no token was counted): the eviction policy's prior (EvictionPolicy::seed).
  std::vector<double> rates(int moe_layer) const;

  // The experts worth warming first: every expert that served a token, the
  // most used first across all layers (each layer sees every token, so
  // counts compare across layers; ties by layer, then expert), as MoE-layer
  // keys. Filling n islands in this order holds the n experts with the most
  // uses the profile saw, the best hit rate it can promise.
  std::vector<ExpertKey> warm_order() const;

  // The share of all uses that the first `islands` experts of warm_order()
  // served (1 when the profile is empty).
  double coverage(size_t islands) const;
};

std::string format_routing_profile(const RoutingProfile& p);
// Checks the format, version, sizes (every layer n_experts counts, layers
// distinct and increasing), and that numbers are non-negative integers; an
// error says what is wrong.
Result<RoutingProfile> parse_routing_profile(std::string_view text);

Result<RoutingProfile> read_routing_profile(const std::string& path);
// Written to a temporary file beside `path`, flushed, then renamed over it:
// a reader (or a crash) sees the old file or the new one, never a part.
Status write_routing_profile(const std::string& path, const RoutingProfile& p);

}  // namespace moe
