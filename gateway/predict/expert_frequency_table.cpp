#include "gateway/predict/expert_frequency_table.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "gateway/predict/prompt_embedding.h"

namespace moe::gw {

ExpertFrequencyTable::ExpertFrequencyTable(int n_layers, int n_experts, FrequencyTableParams params)
    : n_layers_(n_layers), n_experts_(n_experts), prm_(params) {
  if (prm_.half_life <= 0) prm_.half_life = 1e18;  // no decay
  global_.share.assign(size_t(n_layers_) * size_t(n_experts_), 0.0f);
}

double ExpertFrequencyTable::factor(uint64_t from) const {
  return std::exp2(-double(clock_ - from) / prm_.half_life);
}

void ExpertFrequencyTable::add(Row& r, std::span<const float> usage) {
  const double f = factor(r.at);
  if (f != 1.0) {
    for (float& v : r.share) v = float(v * f);
    r.weight *= f;
  }
  r.at = clock_;
  const size_t E = size_t(n_experts_);
  for (size_t l = 0; l < size_t(n_layers_); ++l) {
    double sum = 0;
    for (size_t e = 0; e < E; ++e) sum += usage[l * E + e];
    if (sum <= 0) continue;
    for (size_t e = 0; e < E; ++e) r.share[l * E + e] += float(usage[l * E + e] / sum);
  }
  r.weight += 1.0;
}

void ExpertFrequencyTable::learn(uint32_t bucket, std::span<const float> usage) {
  if (usage.size() != size_t(n_layers_) * size_t(n_experts_)) return;
  ++clock_;
  Row& r = rows_[bucket];
  if (r.share.empty()) {
    r.share.assign(usage.size(), 0.0f);
    r.at = clock_;
  }
  add(r, usage);
  add(global_, usage);
  // Rows that decayed to nothing are dropped now and then, so the table stays
  // as large as the traffic of the last few half-lives.
  if (clock_ % 1024 == 0) prune();
}

void ExpertFrequencyTable::prune() {
  for (auto it = rows_.begin(); it != rows_.end();)
    it = decayed(it->second) < prm_.min_weight * 0.1 ? rows_.erase(it) : std::next(it);
}

double ExpertFrequencyTable::weight(uint32_t bucket) const {
  auto it = rows_.find(bucket);
  return it == rows_.end() ? 0.0 : decayed(it->second);
}

ExpertFrequencyTable::Estimate ExpertFrequencyTable::estimate(uint32_t bucket) const {
  Estimate est;
  const size_t n = size_t(n_layers_) * size_t(n_experts_);
  const Row* row = nullptr;
  auto it = rows_.find(bucket);
  if (it != rows_.end() && decayed(it->second) >= prm_.min_weight) {
    row = &it->second;
    est.source = Source::bucket;
    est.bucket = bucket;
  } else {
    int best_d = prm_.nearest_max_distance + 1;
    double best_w = 0;
    for (const auto& [b, r] : rows_) {
      const int d = hamming(b, bucket);
      const double w = decayed(r);
      if (w < prm_.min_weight || d > prm_.nearest_max_distance) continue;
      if (d < best_d || (d == best_d && w > best_w) ||
          (d == best_d && w == best_w && b < est.bucket)) {
        best_d = d;
        best_w = w;
        row = &r;
        est.bucket = b;
      }
    }
    if (row) {
      est.source = Source::nearest;
      est.distance = best_d;
    }
  }
  const double gw = decayed(global_);
  if (!row && gw <= 0) return est;  // nothing learned yet
  if (!row) est.source = Source::global;
  // share_row + prior * global_mean, per layer normalised: a thin bucket
  // leans on what all traffic does, a well-fed one speaks for itself.
  est.p.assign(n, 0.0f);
  const double rf = row ? factor(row->at) : 0.0;
  const double gf = factor(global_.at);
  const double prior = row ? prm_.prior_summaries : 1.0;
  const size_t E = size_t(n_experts_);
  for (size_t l = 0; l < size_t(n_layers_); ++l) {
    double sum = 0;
    for (size_t e = 0; e < E; ++e) {
      const size_t i = l * E + e;
      double v = gw > 0 ? prior * global_.share[i] * gf / gw : 0.0;
      if (row) v += row->share[i] * rf;
      est.p[i] = float(v);
      sum += v;
    }
    if (sum > 0)
      for (size_t e = 0; e < E; ++e) est.p[l * E + e] = float(est.p[l * E + e] / sum);
  }
  return est;
}

std::vector<std::vector<int>> ExpertFrequencyTable::top_experts(const Estimate& e, int n_experts,
                                                                int n) {
  std::vector<std::vector<int>> out;
  if (e.p.empty() || n_experts <= 0) return out;
  const size_t layers = e.p.size() / size_t(n_experts);
  out.resize(layers);
  for (size_t l = 0; l < layers; ++l) {
    std::vector<int> idx(static_cast<size_t>(n_experts));
    std::iota(idx.begin(), idx.end(), 0);
    const float* p = e.p.data() + l * size_t(n_experts);
    std::stable_sort(idx.begin(), idx.end(), [p](int a, int b) { return p[a] > p[b]; });
    for (int k = 0; k < std::min(n, n_experts) && p[idx[size_t(k)]] > 0; ++k)
      out[l].push_back(idx[size_t(k)]);
  }
  return out;
}

}  // namespace moe::gw
