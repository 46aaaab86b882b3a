#pragma once
// Predicts the next MoE layer's experts from the current layer's routing,
// learned online: a per-layer transition table counts how often a token
// routed to expert a at layer l goes to expert b at layer l+1. The
// prefetcher hints the best guesses one layer ahead so their copies overlap
// the current layer's compute. The last layer predicts layer 0 of the next
// token (decode steps go round the layers).
//
// Threads: owned by the worker's step thread, like the residency map.

#include <cstdint>
#include <span>
#include <vector>

namespace moe {

struct PredictorParams {
  int max_experts = 4;            // at most this many guesses per layer
  double min_probability = 0.15;  // skip guesses below this estimated chance
  double prior = 1.0;             // pseudo-count spread over a row (avoids 0/0 early)
};

class ExpertPredictor {
 public:
  ExpertPredictor(int n_layers, int n_experts, PredictorParams params = {});

  // Records one token's routing at `layer` (its top-k experts). Call in the
  // order the step visits layers; a transition is learned from the previous
  // observation when it was the layer before (cyclically).
  void observe(int layer, std::span<const int> experts);

  // Best guesses for `layer + 1` (cyclic) given the experts routed at `layer`
  // just now, most likely first.
  std::vector<int> predict_next(int layer, std::span<const int> experts) const;

  // Estimated chance that a token routed to `experts` at `layer` uses
  // expert `next` at the following layer (tests).
  double probability(int layer, std::span<const int> experts, int next) const;

 private:
  size_t row(int layer, int expert) const {
    return (size_t(layer) * size_t(n_experts_) + size_t(expert)) * size_t(n_experts_);
  }
  int n_layers_, n_experts_;
  PredictorParams prm_;
  std::vector<float> counts_;     // [layer, from, to]: transitions layer -> layer+1
  std::vector<float> row_total_;  // [layer, from]: tokens seen with `from` at layer
  int prev_layer_ = -1;
  std::vector<int> prev_experts_;
};

}  // namespace moe
