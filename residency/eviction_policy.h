#pragma once
// Which resident expert leaves its island when a new one needs it. The
// residency map (residency/residency.h) tells the policy what happens and
// asks it how much each resident expert is worth keeping; it evicts the
// cheapest one that is neither pinned nor predicted. Policies here: LRU,
// LFU with decay and the project's phase-aware expected-reuse policy
// ("ours"); Belady's MIN, for offline replay, is in replay/belady_policy.h
// (docs/memory-islands.md).
//
// Threads: a policy belongs to one ResidencyMap and is called on that map's
// thread only (the worker's step thread).

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

namespace moe {

struct ExpertKey {
  int layer = 0;   // MoE layer index
  int expert = 0;  // routed expert index within the layer
  bool operator==(const ExpertKey&) const = default;
};

class EvictionPolicy {
 public:
  virtual ~EvictionPolicy() = default;
  virtual std::string name() const = 0;

  // Called once by the map before any other call.
  virtual void attach(int n_layers, int n_experts) = 0;
  // The step used `key` (one acquire). `now` counts the map's acquires from 0.
  virtual void on_access(ExpertKey key, uint64_t now) = 0;
  // `key` was copied into an island (a demand miss or a prefetch).
  virtual void on_load(ExpertKey key, uint64_t now) {}
  // `key` left its island.
  virtual void on_evict(ExpertKey key, uint64_t now) {}
  // How much keeping `key` resident is worth at `now`: the map evicts the
  // smallest score among unprotected residents (ties: the lowest island).
  virtual double keep_score(ExpertKey key, uint64_t now) const = 0;
  // Whether a streamed (non-resident) `candidate` may be worth an island at
  // all, before any victim is looked for (ResidencyMap::admit asks first:
  // finding the victim scores hundreds of residents). Default: yes.
  virtual bool may_admit(ExpertKey candidate, uint64_t now) const { return true; }
  // Whether `candidate` should take `victim`'s island: by default when it
  // scores higher.
  virtual bool worth_admitting(ExpertKey candidate, ExpertKey victim, uint64_t now) const {
    return keep_score(candidate, now) > keep_score(victim, now);
  }
  // A prior belief, before any use: `rates[e]` is the share of tokens that
  // expert e of `layer` served in a routing profile (residency/routing_profile.h),
  // in [0, 1]. Policies that estimate popularity start from it, weighted as
  // their own memory of past traffic, and let real uses take over; a layer
  // already used keeps what it learned. Default: nothing (recency has no prior).
  virtual void seed(int layer, std::span<const double> rates) {}
};

// ---- Least recently used: the score is the time of the last use or load.
class LruPolicy final : public EvictionPolicy {
 public:
  std::string name() const override { return "lru"; }
  void attach(int n_layers, int n_experts) override;
  void on_access(ExpertKey key, uint64_t now) override;
  void on_load(ExpertKey key, uint64_t now) override;
  double keep_score(ExpertKey key, uint64_t now) const override;

 private:
  int n_experts_ = 0;
  std::vector<uint64_t> last_;  // [layer * n_experts + expert]
};

// ---- Least frequently used with exponential decay: each use adds 1, and
// the count halves every `half_life` acquires, so old popularity fades.
// Compared in the log domain, log2(count at stamp) + stamp / half_life, which
// orders residents exactly as their counts decayed to any common `now` would,
// but is computed once per use instead of once per candidate per eviction.
class LfuDecayPolicy final : public EvictionPolicy {
 public:
  explicit LfuDecayPolicy(double half_life_acquires = 2048.0);
  std::string name() const override { return "lfu"; }
  void attach(int n_layers, int n_experts) override;
  void on_access(ExpertKey key, uint64_t now) override;
  double keep_score(ExpertKey key, uint64_t now) const override;
  // The rate as counts one half-life of acquires would hold.
  void seed(int layer, std::span<const double> rates) override;

 private:
  double half_life_;
  int n_layers_ = 0;
  int n_experts_ = 0;
  std::vector<double> count_;    // decayed uses as of stamp_
  std::vector<uint64_t> stamp_;  // acquire counter of the last update
  std::vector<double> score_;    // log2(count_) + stamp_ / half_life_; lowest when never used
};

// ---- The project's policy: evict the expert expected to be needed last.
// Accesses come layer by layer, so an expert of layer l can next be used only
// when the step reaches l again ("phase"), and then with the probability p
// that a visit of l routes to it. Expected time to next use, in acquires:
//   E[T] = phase(l) + period(l) * (1 - p) / p
// p mixes a slowly decaying per-visit use rate (popularity) with a fast one
// (routing is bursty: an expert used now is likelier next token). The score
// is -E[T]. Visits of a layer are runs of consecutive acquires of that layer.
struct OursPolicyParams {
  double long_half_life_visits = 128.0;  // popularity memory, in visits of the layer
  double short_half_life_visits = 4.0;   // burst memory
  double short_weight = 0.25;            // share of the burst estimate in p
  double p_floor = 1e-3;                 // unseen experts: rare, not impossible
  // A streamed expert is admitted only when its use probability stands this
  // many standard deviations above its layer's mean, the deviation that
  // estimate would have if every expert of the layer were used at random at
  // that mean (and it scores above its victim). Under uniform routing no
  // expert does, and copying one in for another would only spend the link;
  // the victim alone is no yardstick: the cheapest of hundreds of residents
  // is an outlier of noisy estimates. A fixed ratio to the mean does not
  // carry across batch sizes: at batch 1 (a mean of k/E) 3x the mean is ~5.5
  // deviations, but a pass of 8 tokens uses ~40 % of a layer's experts, and
  // an expert one sequence uses every token is then only 2.5x the mean.
  double admit_sigmas = 5.0;
};

class OursPolicy final : public EvictionPolicy {
 public:
  explicit OursPolicy(OursPolicyParams params = {});
  std::string name() const override { return "ours"; }
  void attach(int n_layers, int n_experts) override;
  void on_access(ExpertKey key, uint64_t now) override;
  double keep_score(ExpertKey key, uint64_t now) const override;
  bool may_admit(ExpertKey candidate, uint64_t now) const override;
  bool worth_admitting(ExpertKey candidate, ExpertKey victim, uint64_t now) const override;
  // Both estimates start at the rate, as if the layer had been visited
  // long_half_life_visits times at batch 1 with that routing.
  void seed(int layer, std::span<const double> rates) override;

  // The per-visit use probability the policy currently believes (tests).
  double use_probability(ExpertKey key) const;

 private:
  struct Rate {
    double uses = 0;    // decayed uses as of `stamp`
    int64_t stamp = 0;  // visits of the layer at the last update
  };
  // factor^k from a table: keep_score runs for every candidate of every
  // eviction, so it must not call pow.
  static double decay(const std::vector<double>& table, int64_t k) {
    return k < int64_t(table.size()) ? table[size_t(k)] : 0.0;
  }

  OursPolicyParams prm_;
  std::vector<double> long_pow_, short_pow_;        // [k] per-visit decay factor^k
  std::vector<double> long_visits_, short_visits_;  // [layer] decayed visit counts
  // [layer] sums of the squared weights of each estimate and of their
  // products, for the spread of an estimate (may_admit)
  std::vector<double> long_sq_, short_sq_, cross_;
  int n_layers_ = 0, n_experts_ = 0;
  int cur_layer_ = -1;                    // layer of the current visit
  std::vector<int64_t> visits_;           // [layer] visits so far
  std::vector<int64_t> seeded_at_;        // [layer] the visits a seed stood for (-1: not seeded)
  std::vector<uint64_t> visit_start_;     // [layer] acquire counter at the last visit's start
  std::vector<double> period_;            // [layer] smoothed acquires between visits
  std::vector<Rate> long_, short_;        // [layer * n_experts + expert]
  std::vector<uint64_t> last_visit_use_;  // [key] visit (1-based) of the last use, 0: never
  // A layer's mean use probability, kept while the clock stands (admissions
  // after a pass all read it): [layer] value and the acquire count it is for.
  mutable std::vector<double> mean_p_;
  mutable std::vector<uint64_t> mean_at_;
};

}  // namespace moe
