#include "residency/residency.h"

#include <algorithm>
#include <string>

namespace moe {

namespace {
std::string key_text(ExpertKey k) {
  return "(layer " + std::to_string(k.layer) + ", expert " + std::to_string(k.expert) + ")";
}
}  // namespace

ResidencyMap::ResidencyMap(int n_layers, int n_experts, int64_t n_islands, size_t blob_bytes,
                           std::unique_ptr<EvictionPolicy> policy, int64_t max_scan)
    : n_layers_(n_layers),
      n_experts_(n_experts),
      blob_bytes_(blob_bytes),
      max_scan_(max_scan),
      policy_(std::move(policy)) {
  island_of_.assign(size_t(n_layers) * size_t(n_experts), -1);
  key_of_.assign(size_t(n_islands), -1);
  key_at_.assign(size_t(n_islands), ExpertKey{});
  pins_.assign(size_t(n_islands), 0);
  predicted_.assign(size_t(n_islands), 0);
  prefetched_.assign(size_t(n_islands), 0);
  // Highest index at the bottom so islands fill from 0 up.
  for (int64_t i = n_islands; i-- > 0;) free_.push_back(i);
  policy_->attach(n_layers, n_experts);
}

bool ResidencyMap::valid(ExpertKey k) const {
  return k.layer >= 0 && k.layer < n_layers_ && k.expert >= 0 && k.expert < n_experts_;
}

int64_t ResidencyMap::lookup(ExpertKey key) const {
  return valid(key) ? island_of_[index_of(key)] : -1;
}

std::optional<ExpertKey> ResidencyMap::resident(int64_t island) const {
  if (island < 0 || island >= n_islands() || key_of_[size_t(island)] < 0) return std::nullopt;
  const int64_t k = key_of_[size_t(island)];
  return ExpertKey{int(k / n_experts_), int(k % n_experts_)};
}

int ResidencyMap::pin_count(ExpertKey key) const {
  const int64_t i = lookup(key);
  return i < 0 ? 0 : pins_[size_t(i)];
}

bool ResidencyMap::is_predicted(ExpertKey key) const {
  const int64_t i = lookup(key);
  return i >= 0 && predicted_[size_t(i)];
}

int64_t ResidencyMap::take_island(bool allow_predicted_victims, std::optional<ExpertKey>* evicted) {
  if (!free_.empty()) {
    const int64_t i = free_.back();
    free_.pop_back();
    return i;
  }
  const int64_t v = choose_victim(allow_predicted_victims);
  if (v >= 0) evict_island(v, evicted);
  return v;
}

int64_t ResidencyMap::choose_victim(bool allow_predicted_victims) {
  // Cheapest unpinned resident; predicted ones only when nothing else is left.
  // With max_scan, the candidates are the next max_scan unpredicted ones from
  // a cursor that moves on each time (a rotating window, like a clock hand).
  const int64_t n = n_islands();
  const bool whole = max_scan_ <= 0 || n <= max_scan_;
  const int64_t start = whole ? 0 : scan_cursor_;
  int64_t best = -1, considered = 0, j = 0;
  bool best_pred = true;
  double best_score = 0;
  for (; j < n && (whole || considered < max_scan_); ++j) {
    const int64_t i = start + j < n ? start + j : start + j - n;
    if (key_of_[size_t(i)] < 0 || pins_[size_t(i)] > 0) continue;
    const bool pred = predicted_[size_t(i)] != 0;
    if (pred && !allow_predicted_victims) continue;
    considered += !pred;
    const double s = policy_->keep_score(key_at_[size_t(i)], now_);
    if (best < 0 || (best_pred && !pred) || (pred == best_pred && s < best_score)) {
      best = i;
      best_pred = pred;
      best_score = s;
    }
  }
  if (!whole) scan_cursor_ = (start + j) % n;
  return best;
}

void ResidencyMap::evict_island(int64_t island, std::optional<ExpertKey>* evicted) {
  const ExpertKey victim = key_at_[size_t(island)];
  island_of_[index_of(victim)] = -1;
  key_of_[size_t(island)] = -1;
  predicted_[size_t(island)] = 0;
  prefetched_[size_t(island)] = 0;
  policy_->on_evict(victim, now_);
  ++stats_.evictions;
  --stats_.islands_in_use;
  *evicted = victim;
}

void ResidencyMap::place(ExpertKey key, int64_t island) {
  island_of_[index_of(key)] = island;
  key_of_[size_t(island)] = int64_t(index_of(key));
  key_at_[size_t(island)] = key;
  pins_[size_t(island)] = 0;
  ++stats_.islands_in_use;
  stats_.bytes_copied += blob_bytes_;
  policy_->on_load(key, now_);
}

Result<Placement> ResidencyMap::acquire(ExpertKey key) {
  if (!valid(key)) return make_error("residency: no such expert " + key_text(key));
  Placement p;
  p.key = key;
  int64_t i = island_of_[index_of(key)];
  if (i >= 0) {
    p.hit = true;
    ++stats_.hits;
    if (prefetched_[size_t(i)]) ++stats_.prefetch_used;
  } else {
    i = take_island(/*allow_predicted_victims=*/true, &p.evicted);
    if (i < 0)
      return make_error("residency: all " + std::to_string(n_islands()) +
                        " islands are pinned; cannot load " + key_text(key));
    place(key, i);
    ++stats_.misses;
  }
  predicted_[size_t(i)] = 0;
  prefetched_[size_t(i)] = 0;
  ++pins_[size_t(i)];
  p.island = i;
  policy_->on_access(key, now_);
  ++now_;
  return p;
}

void ResidencyMap::note_use(ExpertKey key, Served how) {
  if (!valid(key)) return;
  if (how == Served::island) {
    ++stats_.hits;
  } else {
    ++stats_.misses;
    if (how == Served::streamed) ++stats_.streamed;
    if (how == Served::host) ++stats_.host_computed;
  }
  if (const int64_t i = island_of_[index_of(key)]; i >= 0) {
    if (prefetched_[size_t(i)]) ++stats_.prefetch_used;
    predicted_[size_t(i)] = 0;
    prefetched_[size_t(i)] = 0;
  }
  policy_->on_access(key, now_);
  ++now_;
}

std::optional<Placement> ResidencyMap::admit(ExpertKey key) {
  if (!valid(key) || island_of_[index_of(key)] >= 0) return std::nullopt;
  Placement p;
  p.key = key;
  if (!free_.empty()) {
    p.island = free_.back();
    free_.pop_back();
  } else {
    if (!policy_->may_admit(key, now_)) return std::nullopt;  // before scoring any victim
    const int64_t v = choose_victim(/*allow_predicted_victims=*/false);
    if (v < 0 || !policy_->worth_admitting(key, key_at_[size_t(v)], now_)) return std::nullopt;
    evict_island(v, &p.evicted);
    p.island = v;
  }
  place(key, p.island);
  ++stats_.admissions;
  return p;
}

Status ResidencyMap::pin(ExpertKey key) {
  const int64_t i = lookup(key);
  if (i < 0) return make_error("residency: cannot pin " + key_text(key) + ": not resident");
  ++pins_[size_t(i)];
  return {};
}

Status ResidencyMap::unpin(ExpertKey key) {
  const int64_t i = lookup(key);
  if (i < 0) return make_error("residency: cannot unpin " + key_text(key) + ": not resident");
  if (pins_[size_t(i)] == 0) return make_error("residency: " + key_text(key) + " is not pinned");
  --pins_[size_t(i)];
  return {};
}

Status ResidencyMap::drop(ExpertKey key) {
  if (!valid(key)) return make_error("expert out of range");
  const int64_t i = island_of_[index_of(key)];
  if (i < 0) return {};
  if (pins_[size_t(i)] > 0) return make_error("expert is in use by the current step");
  island_of_[index_of(key)] = -1;
  key_of_[size_t(i)] = -1;
  predicted_[size_t(i)] = 0;
  prefetched_[size_t(i)] = 0;
  policy_->on_evict(key, now_);
  --stats_.islands_in_use;
  free_.push_back(i);
  return {};
}

Result<std::vector<ExpertKey>> ResidencyMap::retire_islands(int64_t keep) {
  keep = std::clamp<int64_t>(keep, 0, n_islands());
  for (int64_t i = keep; i < n_islands(); ++i)
    if (key_of_[size_t(i)] >= 0 && pins_[size_t(i)] > 0)
      return make_error("residency: island " + std::to_string(i) + " holds an expert in use");
  std::vector<ExpertKey> evicted;
  for (int64_t i = keep; i < n_islands(); ++i) {
    if (key_of_[size_t(i)] < 0) continue;
    std::optional<ExpertKey> e;
    evict_island(i, &e);
    --stats_.evictions;  // not the policy's choice: the room went to KV
    evicted.push_back(*e);
  }
  free_.erase(std::remove_if(free_.begin(), free_.end(), [&](int64_t i) { return i >= keep; }), free_.end());
  key_of_.resize(size_t(keep));
  key_at_.resize(size_t(keep));
  pins_.resize(size_t(keep));
  predicted_.resize(size_t(keep));
  prefetched_.resize(size_t(keep));
  if (scan_cursor_ >= keep) scan_cursor_ = 0;
  return evicted;
}

void ResidencyMap::restore_islands(int64_t n) {
  const int64_t from = n_islands();
  if (n <= from) return;
  key_of_.resize(size_t(n), -1);
  key_at_.resize(size_t(n), ExpertKey{});
  pins_.resize(size_t(n), 0);
  predicted_.resize(size_t(n), 0);
  prefetched_.resize(size_t(n), 0);
  // Under the free ones already there: the lower islands keep filling first.
  std::vector<int64_t> added;
  for (int64_t i = n; i-- > from;) added.push_back(i);
  free_.insert(free_.begin(), added.begin(), added.end());
}

std::vector<Placement> ResidencyMap::hint(int layer, std::span<const int> experts,
                                          HintPriority priority) {
  std::vector<Placement> loads;
  for (int e : experts) {
    const ExpertKey key{layer, e};
    if (!valid(key)) continue;
    int64_t i = island_of_[index_of(key)];
    if (i >= 0) {
      if (priority == HintPriority::prefetch) predicted_[size_t(i)] = 1;
      continue;
    }
    Placement p;
    p.key = key;
    if (priority == HintPriority::warm) {
      if (free_.empty()) {
        ++stats_.hints_dropped;
        continue;
      }
      i = free_.back();
      free_.pop_back();
    } else {
      i = take_island(/*allow_predicted_victims=*/false, &p.evicted);
      if (i < 0) {
        ++stats_.hints_dropped;
        continue;
      }
    }
    place(key, i);
    ++stats_.prefetches;
    prefetched_[size_t(i)] = 1;
    predicted_[size_t(i)] = priority == HintPriority::prefetch;
    p.island = i;
    loads.push_back(p);
  }
  return loads;
}

void ResidencyMap::clear_predictions(int layer) {
  for (int64_t i = 0; i < n_islands(); ++i)
    if (predicted_[size_t(i)] && key_of_[size_t(i)] / n_experts_ == layer)
      predicted_[size_t(i)] = 0;
}

Status ResidencyMap::check_invariants() const {
  int64_t used = 0;
  for (int64_t i = 0; i < n_islands(); ++i) {
    const int64_t k = key_of_[size_t(i)];
    if (k < 0) {
      if (pins_[size_t(i)] || predicted_[size_t(i)] || prefetched_[size_t(i)])
        return make_error("free island " + std::to_string(i) + " carries pins or flags");
      continue;
    }
    ++used;
    if (int64_t(index_of(key_at_[size_t(i)])) != k)
      return make_error("island " + std::to_string(i) + " key copy is stale");
    if (island_of_[size_t(k)] != i)
      return make_error("island " + std::to_string(i) + " holds key " + std::to_string(k) +
                        " which maps to island " + std::to_string(island_of_[size_t(k)]));
    if (pins_[size_t(i)] < 0) return make_error("negative pin count");
  }
  for (size_t k = 0; k < island_of_.size(); ++k) {
    const int64_t i = island_of_[k];
    if (i >= 0 && (i >= n_islands() || key_of_[size_t(i)] != int64_t(k)))
      return make_error("key " + std::to_string(k) + " maps to island " + std::to_string(i) +
                        " which holds another");
  }
  std::vector<uint8_t> seen(size_t(n_islands()), 0);
  for (int64_t i : free_) {
    if (i < 0 || i >= n_islands() || key_of_[size_t(i)] >= 0 || seen[size_t(i)])
      return make_error("free list holds island " + std::to_string(i) + " twice or while occupied");
    seen[size_t(i)] = 1;
  }
  if (used + int64_t(free_.size()) != n_islands())
    return make_error("islands lost: used + free != total");
  if (used != stats_.islands_in_use)
    return make_error("islands_in_use counter disagrees with the table");
  if (stats_.bytes_copied != stats_.copies() * blob_bytes_)
    return make_error("bytes_copied disagrees with copied misses + prefetches + admissions");
  return {};
}

}  // namespace moe
