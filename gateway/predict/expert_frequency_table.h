#pragma once
// Which experts the prompts of one LSH bucket use, learned online from the
// workers' routing summaries (docs/expert-prediction.md).
//
// Each bucket keeps, per MoE layer, a decayed sum of the share of tokens each
// expert served in the requests learned so far (every request weighs 1 per
// layer, whatever its length). The decay runs on a clock of learned
// summaries: after `half_life` more summaries, an old one counts half, so the
// table follows traffic that changes. A global row learns every summary too;
// it is the fallback for a bucket nobody has seen nearby, and a prior that
// smooths a bucket's first few summaries.
//
// Threading: loop thread only.

#include <cstdint>
#include <span>
#include <string>
#include <unordered_map>
#include <vector>

#include "protocol/redis_schema.h"

namespace moe::gw {

struct FrequencyTableParams {
  double half_life = 500;  // summaries after which a learned one weighs half
  double prior_summaries =
      0.5;  // the global row's weight, in summaries, inside a bucket's estimate
  int nearest_max_distance = 4;  // farthest Hamming distance the nearest-bucket fallback goes
  double min_weight = 0.05;      // a bucket lighter than this (decayed) counts as unseen
};

// A worker's routing summary → tokens per [layer * n_experts + expert]; the
// format is the Redis schema's (protocol/redis_schema.h).
using protocol::parse_routing_layers;

class ExpertFrequencyTable {
 public:
  ExpertFrequencyTable(int n_layers, int n_experts, FrequencyTableParams params = {});

  int n_layers() const { return n_layers_; }
  int n_experts() const { return n_experts_; }

  // One request's use: tokens per [layer * n_experts + expert].
  void learn(uint32_t bucket, std::span<const float> usage);

  enum class Source { bucket, nearest, global, none };
  struct Estimate {
    Source source = Source::none;
    uint32_t bucket = 0;  // the row used (source bucket or nearest)
    int distance = 0;     // Hamming distance to it
    std::vector<float>
        p;  // [layer * n_experts + expert]: estimated share, each layer sums to 1 (zeros: none)
  };
  // The estimate for `bucket`: its own row when known, else the nearest
  // known one within nearest_max_distance, else the global row.
  Estimate estimate(uint32_t bucket) const;
  // The `n` most likely experts of each layer, best first ([layer][rank]).
  static std::vector<std::vector<int>> top_experts(const Estimate& e, int n_experts, int n);

  size_t buckets() const { return rows_.size(); }
  uint64_t learned() const { return clock_; }
  double weight(uint32_t bucket) const;  // decayed summaries in the bucket (0 if unknown)
  double global_weight() const { return decayed(global_); }

 private:
  struct Row {
    std::vector<float> share;  // [layer * n_experts + expert], weight as of `at`
    double weight = 0;         // summaries, as of `at`
    uint64_t at = 0;           // clock when last scaled
  };
  double factor(uint64_t from) const;  // decay from clock `from` to now
  double decayed(const Row& r) const { return r.weight * factor(r.at); }
  void add(Row& r, std::span<const float> usage);
  void prune();

  int n_layers_, n_experts_;
  FrequencyTableParams prm_;
  std::unordered_map<uint32_t, Row> rows_;
  Row global_;
  uint64_t clock_ = 0;
};

}  // namespace moe::gw
