#include "residency/expert_predictor.h"

#include <algorithm>
#include <numeric>

namespace moe {

ExpertPredictor::ExpertPredictor(int n_layers, int n_experts, PredictorParams params)
    : n_layers_(n_layers), n_experts_(n_experts), prm_(params) {
  counts_.assign(size_t(n_layers) * size_t(n_experts) * size_t(n_experts), 0.0f);
  row_total_.assign(size_t(n_layers) * size_t(n_experts), 0.0f);
}

void ExpertPredictor::observe(int layer, std::span<const int> experts) {
  if (layer < 0 || layer >= n_layers_) return;
  if (prev_layer_ >= 0 && (prev_layer_ + 1) % n_layers_ == layer) {
    for (int a : prev_experts_) {
      row_total_[size_t(prev_layer_) * size_t(n_experts_) + size_t(a)] += 1.0f;
      for (int b : experts)
        if (b >= 0 && b < n_experts_) counts_[row(prev_layer_, a) + size_t(b)] += 1.0f;
    }
  }
  prev_layer_ = layer;
  prev_experts_.clear();
  for (int e : experts)
    if (e >= 0 && e < n_experts_) prev_experts_.push_back(e);
}

double ExpertPredictor::probability(int layer, std::span<const int> experts, int next) const {
  // Average of P(next | a) over the routed experts a: each is one witness.
  double sum = 0;
  int n = 0;
  for (int a : experts) {
    if (a < 0 || a >= n_experts_) continue;
    const double tot = row_total_[size_t(layer) * size_t(n_experts_) + size_t(a)];
    sum += (counts_[row(layer, a) + size_t(next)] + prm_.prior / n_experts_) / (tot + prm_.prior);
    ++n;
  }
  return n ? sum / n : 0.0;
}

std::vector<int> ExpertPredictor::predict_next(int layer, std::span<const int> experts) const {
  if (layer < 0 || layer >= n_layers_) return {};
  std::vector<double> p(static_cast<size_t>(n_experts_));
  for (int b = 0; b < n_experts_; ++b) p[size_t(b)] = probability(layer, experts, b);
  std::vector<int> order(static_cast<size_t>(n_experts_));
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](int x, int y) { return p[size_t(x)] > p[size_t(y)]; });
  std::vector<int> out;
  for (int b : order) {
    if (int(out.size()) >= prm_.max_experts || p[size_t(b)] < prm_.min_probability) break;
    out.push_back(b);
  }
  return out;
}

}  // namespace moe
