// moe replay-trace: runs a routing trace through the worker's residency map
// under each eviction policy and prints hit rate and bytes moved
// (docs/memory-islands.md).

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include "replay/trace_replay.h"
#include "model/int4.h"
#include "model/model_config.h"
#include "tools/moe/commands.h"

namespace moe::cli {

namespace {

void usage(FILE* out) {
  std::fprintf(
      out,
      "usage: moe replay-trace --trace FILE (--slots N | --resident-fraction F) [options]\n\n"
      "  --trace FILE              JSON lines {\"token\",\"layer\",\"experts\"} or a .safetensors\n"
      "                            file with an integer [layers, tokens, top_k] tensor\n"
      "  --tensor NAME             tensor in a .safetensors trace (default eval.routing_topk)\n"
      "  --slots N                 expert islands, across all layers\n"
      "  --resident-fraction F     islands as a fraction of layers x experts (0..1]\n"
      "  --policy P                lru, lfu, ours, ours+prediction, belady, or all (default)\n"
      "  --model DIR               expert blob bytes from the model's config.json (INT4)\n"
      "  --group G                 INT4 group size for --model (default 64)\n"
      "  --expert-bytes B          expert blob bytes, given directly\n"
      "  --first-token N           replay from the trace's token N (default 0)\n"
      "  --tokens N                replay only N tokens (default: to the end)\n"
      "  --warm-profile FILE       start as `moe-worker --warm-profile FILE` does: the policy's\n"
      "                            prior from the profile, its most used experts in the islands\n"
      "  --no-seed                 with --warm-profile: warm the islands only, no prior\n\n"
      "prints: policy=<name> hit_rate=<0..1> bytes=<moved> and the map's other counters\n");
}

bool parse_i64(const char* s, int64_t* out) {
  char* end = nullptr;
  const long long v = std::strtoll(s, &end, 10);
  if (!end || *end || end == s) return false;
  *out = v;
  return true;
}

}  // namespace

int cmd_replay_trace(int argc, char** argv) {
  std::string trace_path, tensor = "eval.routing_topk", policy = "all", model_dir, profile_path;
  int64_t slots = 0, group = 64, expert_bytes = 0, first_token = 0, n_tokens = -1;
  bool seed = true;
  double fraction = 0;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    const bool has = i + 1 < argc;
    if (a == "--help" || a == "-h") {
      usage(stdout);
      return 0;
    }
    if (a == "--no-seed") {
      seed = false;
      continue;
    }
    if (!has) {
      std::fprintf(stderr, "replay-trace: %s needs a value\n", a.c_str());
      return 2;
    }
    const char* v = argv[++i];
    bool ok = true;
    if (a == "--trace")
      trace_path = v;
    else if (a == "--tensor")
      tensor = v;
    else if (a == "--policy")
      policy = v;
    else if (a == "--model")
      model_dir = v;
    else if (a == "--warm-profile")
      profile_path = v;
    else if (a == "--first-token")
      ok = parse_i64(v, &first_token) && first_token >= 0;
    else if (a == "--tokens")
      ok = parse_i64(v, &n_tokens) && n_tokens > 0;
    else if (a == "--slots")
      ok = parse_i64(v, &slots) && slots > 0;
    else if (a == "--group")
      ok = parse_i64(v, &group) && group >= 2;
    else if (a == "--expert-bytes")
      ok = parse_i64(v, &expert_bytes) && expert_bytes > 0;
    else if (a == "--resident-fraction") {
      char* end = nullptr;
      fraction = std::strtod(v, &end);
      ok = end && !*end && fraction > 0 && fraction <= 1;
    } else {
      std::fprintf(stderr, "replay-trace: unknown option %s\n", a.c_str());
      usage(stderr);
      return 2;
    }
    if (!ok) {
      std::fprintf(stderr, "replay-trace: bad value '%s' for %s\n", v, a.c_str());
      return 2;
    }
  }
  if (trace_path.empty() || (slots == 0 && fraction == 0)) {
    usage(stderr);
    return 2;
  }

  int model_experts = 0;
  if (!model_dir.empty()) {
    auto desc = load_model_desc(model_dir);
    if (!desc) {
      std::fprintf(stderr, "replay-trace: %s\n", desc.error().c_str());
      return 1;
    }
    model_experts = desc->moe.n_experts;
    if (expert_bytes == 0)
      expert_bytes = int64_t(
          expert_layout(desc->hidden_size, desc->moe.expert_intermediate, int(group)).blob_bytes);
  }

  auto trace = read_routing_trace(trace_path, tensor);
  if (!trace) {
    std::fprintf(stderr, "replay-trace: %s\n", trace.error().c_str());
    return 1;
  }
  if (first_token > 0 || n_tokens > 0) {
    const size_t all = trace->steps.size();
    trace = trace_slice(*trace, first_token, n_tokens);
    if (trace->steps.empty()) {
      std::fprintf(stderr, "replay-trace: no steps in tokens [%lld, +%lld) of the trace's %zu\n",
                   (long long)first_token, (long long)n_tokens, all);
      return 2;
    }
  }
  std::optional<RoutingProfile> profile;
  if (!profile_path.empty()) {
    auto p = read_routing_profile(profile_path);
    if (!p) {
      std::fprintf(stderr, "replay-trace: %s\n", p.error().c_str());
      return 1;
    }
    profile = std::move(p.value());
  }
  const int n_experts = std::max(model_experts, trace->n_experts);
  const int64_t total = int64_t(trace->n_layers) * n_experts;
  if (slots == 0) slots = std::max<int64_t>(1, std::llround(fraction * double(total)));

  std::vector<std::string> policies;
  if (policy == "all")
    policies = {"lru", "lfu", "ours", "ours+prediction", "belady"};
  else
    policies = {policy};

  std::printf(
      "# trace=%s steps=%zu layers=%d experts=%d top_k=%d slots=%lld (%.1f%% of %lld) "
      "expert_bytes=%lld\n",
      trace_path.c_str(), trace->steps.size(), trace->n_layers, n_experts, trace->top_k,
      (long long)slots, 100.0 * double(slots) / double(total), (long long)total,
      (long long)expert_bytes);
  for (const std::string& name : policies) {
    const std::string suffix = "+prediction";
    const bool predict = name.size() > suffix.size() && name.ends_with(suffix);
    const std::string base = predict ? name.substr(0, name.size() - suffix.size()) : name;
    auto p = make_policy(base, *trace);
    if (!p) {
      std::fprintf(stderr, "replay-trace: %s\n", p.error().c_str());
      return 2;
    }
    ReplayOptions opt;
    opt.slots = slots;
    opt.expert_bytes = size_t(expert_bytes);
    opt.n_experts = n_experts;
    opt.predict = predict;
    opt.warm_profile = profile ? &*profile : nullptr;
    opt.seed = seed;
    auto r = replay_trace(*trace, std::move(p.value()), opt);
    if (!r) {
      std::fprintf(stderr, "replay-trace: %s\n", r.error().c_str());
      return 1;
    }
    const ResidencyStats& s = r->stats;
    std::printf(
        "policy=%s hit_rate=%.4f bytes=%llu hits=%llu misses=%llu prefetches=%llu "
        "prefetch_used=%llu "
        "evictions=%llu\n",
        r->policy.c_str(), s.hit_rate(), (unsigned long long)s.bytes_copied,
        (unsigned long long)s.hits, (unsigned long long)s.misses, (unsigned long long)s.prefetches,
        (unsigned long long)s.prefetch_used, (unsigned long long)s.evictions);
  }
  return 0;
}

}  // namespace moe::cli
