#include "residency/eviction_policy.h"

#include <algorithm>
#include <cmath>
#include <limits>

namespace moe {

namespace {
constexpr uint64_t kNever = std::numeric_limits<uint64_t>::max();

size_t index_of(ExpertKey k, int n_experts) {
  return size_t(k.layer) * size_t(n_experts) + size_t(k.expert);
}
}  // namespace

// ---------------------------------------------------------------- LRU

void LruPolicy::attach(int n_layers, int n_experts) {
  n_experts_ = n_experts;
  last_.assign(size_t(n_layers) * size_t(n_experts), 0);
}

void LruPolicy::on_access(ExpertKey key, uint64_t now) {
  last_[index_of(key, n_experts_)] = now + 1;
}

void LruPolicy::on_load(ExpertKey key, uint64_t now) { last_[index_of(key, n_experts_)] = now + 1; }

double LruPolicy::keep_score(ExpertKey key, uint64_t) const {
  return double(last_[index_of(key, n_experts_)]);
}

// ---------------------------------------------------------------- LFU with decay

LfuDecayPolicy::LfuDecayPolicy(double half_life_acquires)
    : half_life_(std::max(1.0, half_life_acquires)) {}

void LfuDecayPolicy::attach(int n_layers, int n_experts) {
  n_layers_ = n_layers;
  n_experts_ = n_experts;
  const size_t n = size_t(n_layers) * size_t(n_experts);
  count_.assign(n, 0.0);
  stamp_.assign(n, 0);
  score_.assign(n, -std::numeric_limits<double>::max());
}

void LfuDecayPolicy::on_access(ExpertKey key, uint64_t now) {
  const size_t i = index_of(key, n_experts_);
  count_[i] = count_[i] * std::exp2(-double(now - stamp_[i]) / half_life_) + 1.0;
  stamp_[i] = now;
  score_[i] = std::log2(count_[i]) + double(now) / half_life_;
}

void LfuDecayPolicy::seed(int layer, std::span<const double> rates) {
  if (layer < 0 || layer >= n_layers_) return;
  double per_token = 0;  // this layer's acquires a token (top_k)
  for (double r : rates) per_token += r;
  if (per_token <= 0) return;
  // One half-life of acquires covers half_life / (layers x top_k) tokens.
  const double tokens = half_life_ / (double(n_layers_) * per_token);
  for (int e = 0; e < n_experts_; ++e)
    if (count_[index_of({layer, e}, n_experts_)] != 0.0) return;  // it has real uses of its own
  for (size_t e = 0; e < rates.size() && e < size_t(n_experts_); ++e) {
    const size_t i = index_of({layer, int(e)}, n_experts_);
    if (rates[e] <= 0) continue;
    count_[i] = std::clamp(rates[e], 0.0, 1.0) * tokens;
    score_[i] = std::log2(count_[i]);
  }
}

double LfuDecayPolicy::keep_score(ExpertKey key, uint64_t) const {
  return score_[index_of(key, n_experts_)];
}

// ---------------------------------------------------------------- ours

OursPolicy::OursPolicy(OursPolicyParams p) : prm_(p) {
  // Beyond 32 half-lives a weight is below 2^-32: the tables stop there.
  auto table = [](double half_life) {
    const double f = std::exp2(-1.0 / std::max(1e-3, half_life));
    std::vector<double> t(size_t(std::clamp(32.0 * half_life, 2.0, 1e6)));
    double x = 1.0;
    for (double& v : t) {
      v = x;
      x *= f;
    }
    return t;
  };
  long_pow_ = table(prm_.long_half_life_visits);
  short_pow_ = table(prm_.short_half_life_visits);
}

void OursPolicy::attach(int n_layers, int n_experts) {
  n_layers_ = n_layers;
  n_experts_ = n_experts;
  const size_t n = size_t(n_layers) * size_t(n_experts);
  cur_layer_ = -1;
  visits_.assign(size_t(n_layers), 0);
  seeded_at_.assign(size_t(n_layers), -1);
  visit_start_.assign(size_t(n_layers), 0);
  period_.assign(size_t(n_layers), 0.0);
  long_visits_.assign(size_t(n_layers), 0.0);
  short_visits_.assign(size_t(n_layers), 0.0);
  long_sq_.assign(size_t(n_layers), 0.0);
  short_sq_.assign(size_t(n_layers), 0.0);
  cross_.assign(size_t(n_layers), 0.0);
  long_.assign(n, Rate{});
  short_.assign(n, Rate{});
  last_visit_use_.assign(n, 0);
}

void OursPolicy::on_access(ExpertKey key, uint64_t now) {
  const size_t l = size_t(key.layer);
  const size_t i = index_of(key, n_experts_);
  // A new visit starts when the layer changes, or when an expert comes back
  // within the same visit (a model with one MoE layer, or a layer's next step).
  if (key.layer != cur_layer_ || last_visit_use_[i] == uint64_t(visits_[l])) {
    if (visits_[l] > 0 && visits_[l] != seeded_at_[l]) {
      const double gap = double(now - visit_start_[l]);
      period_[l] = period_[l] == 0.0 ? gap : 0.875 * period_[l] + 0.125 * gap;
    }
    ++visits_[l];
    // Sum over the layer's visits j = 1..V of factor^(V - j).
    const double fl = decay(long_pow_, 1), fs = decay(short_pow_, 1);
    long_visits_[l] = long_visits_[l] * fl + 1.0;
    short_visits_[l] = short_visits_[l] * fs + 1.0;
    long_sq_[l] = long_sq_[l] * fl * fl + 1.0;
    short_sq_[l] = short_sq_[l] * fs * fs + 1.0;
    cross_[l] = cross_[l] * fl * fs + 1.0;
    visit_start_[l] = now;
    cur_layer_ = key.layer;
  }
  const int64_t v = visits_[l];
  last_visit_use_[i] = uint64_t(v);
  long_[i] = Rate{long_[i].uses * decay(long_pow_, v - long_[i].stamp) + 1.0, v};
  short_[i] = Rate{short_[i].uses * decay(short_pow_, v - short_[i].stamp) + 1.0, v};
}

void OursPolicy::seed(int layer, std::span<const double> rates) {
  if (layer < 0 || layer >= n_layers_) return;
  const size_t l = size_t(layer);
  if (visits_[l] != 0) return;  // it has real uses of its own
  const int64_t v = std::max<int64_t>(1, int64_t(prm_.long_half_life_visits));
  const double fl = decay(long_pow_, 1), fs = decay(short_pow_, 1);
  double lv = 0, sv = 0, lsq = 0, ssq = 0, cr = 0;
  for (int64_t j = 0; j < v; ++j) {  // the sums on_access would have built over v visits
    lv = lv * fl + 1.0;
    sv = sv * fs + 1.0;
    lsq = lsq * fl * fl + 1.0;
    ssq = ssq * fs * fs + 1.0;
    cr = cr * fl * fs + 1.0;
  }
  visits_[l] = v;
  seeded_at_[l] = v;  // the first real visit measures no period (there was no last one)
  long_visits_[l] = lv;
  short_visits_[l] = sv;
  long_sq_[l] = lsq;
  short_sq_[l] = ssq;
  cross_[l] = cr;
  for (size_t e = 0; e < rates.size() && e < size_t(n_experts_); ++e) {
    const double r = std::clamp(rates[e], 0.0, 1.0);
    const size_t i = index_of({layer, int(e)}, n_experts_);
    long_[i] = Rate{r * lv, v};
    short_[i] = Rate{r * sv, v};
  }
  mean_at_.clear();  // the layers' means are stale
  mean_p_.clear();
}

double OursPolicy::use_probability(ExpertKey key) const {
  const size_t l = size_t(key.layer);
  const int64_t v = visits_[l];
  if (v == 0) return prm_.p_floor;
  const size_t i = index_of(key, n_experts_);
  const double pl = long_[i].uses * decay(long_pow_, v - long_[i].stamp) / long_visits_[l];
  const double ps = short_[i].uses * decay(short_pow_, v - short_[i].stamp) / short_visits_[l];
  return std::clamp((1.0 - prm_.short_weight) * pl + prm_.short_weight * ps, prm_.p_floor, 1.0);
}

double OursPolicy::keep_score(ExpertKey key, uint64_t now) const {
  const size_t l = size_t(key.layer);
  double period = period_[l];
  if (period == 0.0) {  // layer not seen twice yet: borrow the longest known period
    for (double q : period_) period = std::max(period, q);
    if (period == 0.0) period = double(n_layers_);
  }
  double phase;
  if (key.layer == cur_layer_ || visits_[l] == 0)
    phase = key.layer == cur_layer_ ? period : 0.0;
  else
    phase = std::max(0.0, double(visit_start_[l]) + period - double(now));
  const double p = use_probability(key);
  return -(phase + period * (1.0 - p) / p);
}

bool OursPolicy::may_admit(ExpertKey candidate, uint64_t now) const {
  const size_t l = size_t(candidate.layer);
  if (mean_p_.size() != size_t(n_layers_)) {
    mean_p_.assign(size_t(n_layers_), 0.0);
    mean_at_.assign(size_t(n_layers_), UINT64_MAX);
  }
  if (mean_at_[l] != now) {
    double mean = 0;
    for (int e = 0; e < n_experts_; ++e) mean += use_probability({candidate.layer, e});
    mean_p_[l] = mean / double(n_experts_);
    mean_at_[l] = now;
  }
  if (visits_[l] == 0) return false;
  // use_probability mixes two decayed means of the layer's visits (used or
  // not): with normalised weights a_j (long) and b_j (short), a Bernoulli(mu)
  // stream gives it the variance mu (1 - mu) sum_j ((1-w) a_j + w b_j)^2.
  const double mu = mean_p_[l], w = prm_.short_weight;
  const double L1 = long_visits_[l], S1 = short_visits_[l];
  const double c2 = (1 - w) * (1 - w) * long_sq_[l] / (L1 * L1) + w * w * short_sq_[l] / (S1 * S1) +
                    2 * w * (1 - w) * cross_[l] / (L1 * S1);
  const double sd = std::sqrt(std::max(0.0, mu * (1 - mu) * c2));
  return use_probability(candidate) >= mu + prm_.admit_sigmas * sd;
}

bool OursPolicy::worth_admitting(ExpertKey candidate, ExpertKey victim, uint64_t now) const {
  return may_admit(candidate, now) && keep_score(candidate, now) > keep_score(victim, now);
}

}  // namespace moe
