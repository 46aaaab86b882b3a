#include "engine/router_lookahead.h"

#include <algorithm>
#include <numeric>

#include "kernels/cpu/rmsnorm.h"

namespace moe {

RouterLookahead::RouterLookahead(const ModelDesc& d, const ModelWeights& w)
    : d_(d), w_(w), E_(d.moe.n_experts), K_(d.moe.top_k), router_(router_params(d.moe)) {
  const int M = d.n_moe_layers();
  sums_.resize(size_t(M));
  trans_.assign(size_t(M), std::vector<uint32_t>(size_t(E_) * size_t(E_), 0));
  used_.assign(size_t(M), std::vector<uint64_t>(size_t(E_), 0));
  for (int l = 0; l < d.n_layers; ++l)
    if (d.moe_layer_index(l) >= 0) sums_[size_t(d.moe_layer_index(l))].layer = l;
}

std::vector<int> RouterLookahead::top(const float* v, int k) const {
  std::vector<int> idx(static_cast<size_t>(E_));
  std::iota(idx.begin(), idx.end(), 0);
  k = std::min(k, E_);
  std::partial_sort(idx.begin(), idx.begin() + k, idx.end(),
                    [&](int a, int b) { return v[a] != v[b] ? v[a] > v[b] : a < b; });
  idx.resize(size_t(k));
  return idx;
}

std::vector<int> RouterLookahead::route(const float* logits, int k) const {
  cpu::RouterParams p = router_;
  p.top_k = std::min(k, E_);
  std::vector<int32_t> ids(static_cast<size_t>(p.top_k));
  std::vector<float> weights(ids.size());
  cpu::router_topk(logits, 1, p, ids.data(), weights.data());
  return std::vector<int>(ids.begin(), ids.end());
}

std::vector<int> RouterLookahead::guess(int layer, const float* hidden, int k) const {
  const LayerWeights& lw = w_.layers[size_t(layer)];
  const int H = d_.hidden_size;
  std::vector<float> h(static_cast<size_t>(H)), logits(static_cast<size_t>(E_));
  cpu::rmsnorm(hidden, lw.mlp_norm.data(), h.data(), 1, H, d_.rms_eps);
  lw.router.apply(h.data(), logits.data(), 1, nullptr);
  return route(logits.data(), k);
}

namespace {
double recall(const std::vector<int>& truth, const std::vector<int>& guess) {
  int n = 0;
  for (int e : truth) n += std::find(guess.begin(), guess.end(), e) != guess.end();
  return truth.empty() ? 0.0 : double(n) / double(truth.size());
}
}  // namespace

void RouterLookahead::add(const ForwardTrace& trace, int tokens) {
  const int H = d_.hidden_size;
  const int M = d_.n_moe_layers();
  if (int(trace.router_logits.size()) != M || int(trace.mid.size()) != d_.n_layers ||
      int(trace.hidden.size()) < d_.n_layers)
    return;
  for (int t = 0; t < tokens; ++t) {
    std::vector<int> prev_truth;  // the previous MoE layer's true experts (the transition's input)
    for (int m = 0; m < M; ++m) {
      LookaheadLayer& s = sums_[size_t(m)];
      const int l = s.layer;
      const std::vector<int> truth = route(trace.router_logits[size_t(m)].data() + size_t(t) * E_, K_);
      const auto row = [&](const std::vector<std::vector<float>>& v, int layer) {
        return v[size_t(layer)].data() + size_t(t) * H;
      };
      s.entering += recall(truth, guess(l, row(trace.hidden, l), K_));
      if (l >= 1) {
        const std::vector<int> g2 = guess(l, row(trace.mid, l - 1), 2 * K_);
        s.after_attention_prev += recall(truth, std::vector<int>(g2.begin(), g2.begin() + std::min<int>(K_, int(g2.size()))));
        s.after_attention_prev_2k += recall(truth, g2);
      }
      if (l >= 2) s.two_ahead += recall(truth, guess(l, row(trace.mid, l - 2), K_));
      // The baselines guess before they learn from this token.
      if (m >= 1 && !prev_truth.empty()) {
        std::vector<float> score(size_t(E_), 0.f);
        for (int from : prev_truth)
          for (int to = 0; to < E_; ++to) score[size_t(to)] += float(trans_[size_t(m)][size_t(from) * E_ + to]);
        s.transition += recall(truth, top(score.data(), K_));
        for (int from : prev_truth)
          for (int to : truth) ++trans_[size_t(m)][size_t(from) * E_ + to];
      }
      std::vector<float> freq(used_[size_t(m)].begin(), used_[size_t(m)].end());
      s.frequency += recall(truth, top(freq.data(), K_));
      for (int e : truth) ++used_[size_t(m)][size_t(e)];
      ++s.tokens;
      prev_truth = truth;
    }
  }
}

std::vector<LookaheadLayer> RouterLookahead::layers() const {
  std::vector<LookaheadLayer> out = sums_;
  for (LookaheadLayer& s : out) {
    const double n = s.tokens ? double(s.tokens) : 1.0;
    s.after_attention_prev /= n;
    s.after_attention_prev_2k /= n;
    s.entering /= n;
    s.two_ahead /= n;
    s.transition /= n;
    s.frequency /= n;
  }
  return out;
}

}  // namespace moe
