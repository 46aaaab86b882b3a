#pragma once
// The residency map: which (layer, expert) lives in which island of the
// device arena, which islands are free, which residents are pinned (in use
// by the current step) or predicted (prefetched for a coming layer), and the
// counters that show how well it goes. It decides; it copies nothing: a miss
// tells the caller to copy the expert's blob into the island it names
// (residency/island_arena.h does that on the GPU).
//
// Threads: one map belongs to the worker's step thread; every method is
// called on that thread only. Nothing here locks.

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <vector>

#include "residency/eviction_policy.h"
#include "model/result.h"

namespace moe {

struct ResidencyStats {
  uint64_t hits = 0;           // acquires that found the expert resident
  uint64_t misses = 0;         // acquires that needed a copy
  uint64_t prefetches = 0;     // copies started by hints
  uint64_t prefetch_used = 0;  // acquires that hit an expert a prefetch hint loaded
  uint64_t hints_dropped = 0;  // hinted experts not loaded (no island to spare)
  uint64_t evictions = 0;
  uint64_t bytes_copied = 0;   // every copy into an island (misses, prefetches, admissions) * blob bytes
  uint64_t streamed = 0;       // misses a kernel read over the link from host memory (no copy)
  uint64_t host_computed = 0;  // misses of streamed passes the host's cores computed
  uint64_t admissions = 0;     // streamed experts then copied into an island (admit)
  int64_t islands_in_use = 0;  // now
  double hit_rate() const { return hits + misses ? double(hits) / double(hits + misses) : 0.0; }
  // Copies into islands: misses that were copied (not streamed or computed
  // on the host), prefetches and admissions. bytes_copied is this x blob bytes.
  uint64_t copies() const { return misses - streamed - host_computed + prefetches + admissions; }
};

// What an acquire or a hint decided for one expert.
struct Placement {
  ExpertKey key;
  int64_t island = -1;
  bool hit = false;                  // false: copy the blob into `island` before use
  std::optional<ExpertKey> evicted;  // the expert that left `island`, if any
};

enum class HintPriority {
  warm,      // gateway warm hint: load only into free islands, no protection
  prefetch,  // prefetcher: may evict unprotected residents; protected until used
};

class ResidencyMap {
 public:
  // n_islands: IslandPlan::n_islands; blob_bytes: one expert's blob (for the
  // byte counter). The policy is attached here and owned by the map.
  // max_scan bounds the work of one eviction: with more islands than that,
  // each eviction scores only max_scan candidates (a rotating window) instead
  // of every resident; 0 scores all (exact; Belady's replay needs it).
  ResidencyMap(int n_layers, int n_experts, int64_t n_islands, size_t blob_bytes,
               std::unique_ptr<EvictionPolicy> policy, int64_t max_scan = kDefaultMaxScan);

  static constexpr int64_t kDefaultMaxScan = 256;

  int n_layers() const { return n_layers_; }
  int n_experts() const { return n_experts_; }
  int64_t n_islands() const { return int64_t(key_of_.size()); }
  const EvictionPolicy& policy() const { return *policy_; }
  // The policy's prior for `layer` (EvictionPolicy::seed: a routing
  // profile's per-token use rate of each of its experts).
  void seed(int layer, std::span<const double> rates) { policy_->seed(layer, rates); }

  // ---- Lookups
  // The island holding `key`, or -1 when it is not resident.
  int64_t lookup(ExpertKey key) const;
  // The expert in `island`, or nullopt when the island is free.
  std::optional<ExpertKey> resident(int64_t island) const;
  int pin_count(ExpertKey key) const;  // 0 when not resident
  bool is_predicted(ExpertKey key) const;

  // ---- The step's use of experts
  // Makes `key` resident and pins it once (match every acquire with one
  // unpin when the layer's compute no longer reads it). A miss takes a free
  // island or evicts the policy's cheapest unpinned resident, preferring
  // unpredicted ones. Fails only when every island is pinned.
  [[nodiscard]] Result<Placement> acquire(ExpertKey key);
  // Streamed decode (the kernels read a miss from host memory; nothing is
  // pinned): records one use of `key` for the policy and the counters: a
  // hit when the kernels read it from its island, else a miss, streamed
  // over the link or computed by the host's cores.
  enum class Served { island, streamed, host };
  void note_use(ExpertKey key, Served how);
  // After a streamed pass: gives a non-resident `key` an island when one is
  // free, or when the policy finds it worth more than the cheapest unpinned,
  // unpredicted resident (EvictionPolicy::worth_admitting), which it evicts.
  // The caller copies the blob in; nullopt when `key` stays on the host.
  std::optional<Placement> admit(ExpertKey key);

  // Pins a resident expert once more (error when not resident).
  [[nodiscard]] Status pin(ExpertKey key);
  // Drops one pin. Unpinning an expert with no pins is an error.
  [[nodiscard]] Status unpin(ExpertKey key);

  // Drops a resident that nothing pins (an explicit unload); its island
  // becomes free. Error when the expert is pinned; a no-op when it is not
  // resident.
  [[nodiscard]] Status drop(ExpertKey key);

  // ---- The number of islands at run time (docs/kv-islands-trade.md)
  // Islands `keep` and up leave the map: their residents are evicted and
  // returned (the caller points their tables back at the host blobs); none
  // may be pinned (an error, nothing changed). n_islands() becomes keep.
  [[nodiscard]] Result<std::vector<ExpertKey>> retire_islands(int64_t keep);
  // Islands n_islands() … n - 1 join the map, free.
  void restore_islands(int64_t n);

  // ---- Predictions
  // Experts of `layer` likely soon. Returns the copies to start (hit = false)
  // for those not yet resident that got an island; resident ones are only
  // marked. Never evicts pinned or predicted experts.
  std::vector<Placement> hint(int layer, std::span<const int> experts, HintPriority priority);
  // Ends the protection of `layer`'s predictions that were not used (the
  // step calls it once the layer's acquires are done).
  void clear_predictions(int layer);

  // ---- Statistics and checks
  const ResidencyStats& stats() const { return stats_; }
  // Verifies the internal tables agree (tests; O(islands + experts)).
  [[nodiscard]] Status check_invariants() const;

 private:
  size_t index_of(ExpertKey k) const {
    return size_t(k.layer) * size_t(n_experts_) + size_t(k.expert);
  }
  bool valid(ExpertKey k) const;
  // The island for a new resident: a free one, else the cheapest victim.
  // Returns -1 when none may be taken.
  int64_t take_island(bool allow_predicted_victims, std::optional<ExpertKey>* evicted);
  // The cheapest unpinned resident (-1: none may be taken), and its eviction.
  int64_t choose_victim(bool allow_predicted_victims);
  void evict_island(int64_t island, std::optional<ExpertKey>* evicted);
  void place(ExpertKey key, int64_t island);

  int n_layers_ = 0, n_experts_ = 0;
  size_t blob_bytes_ = 0;
  int64_t max_scan_ = 0;
  int64_t scan_cursor_ = 0;  // where the next windowed scan starts
  std::unique_ptr<EvictionPolicy> policy_;
  uint64_t now_ = 0;                // acquires so far: the policies' clock
  std::vector<int64_t> island_of_;  // [layer * n_experts + expert] -> island or -1
  std::vector<int64_t> key_of_;     // [island] -> key index or -1 (free)
  std::vector<ExpertKey>
      key_at_;             // [island] -> its key while occupied (the eviction scan reads it)
  std::vector<int> pins_;  // [island]
  std::vector<uint8_t> predicted_;   // [island]: loaded or marked by a prefetch hint, not used yet
  std::vector<uint8_t> prefetched_;  // [island]: loaded by a hint, not used yet
  std::vector<int64_t> free_;        // free islands (a stack)
  ResidencyStats stats_;
};

}  // namespace moe
