#pragma once
// Belady's MIN for offline replay of a routing trace: evicts the expert
// whose next use is farthest in the future, which needs the whole access
// sequence in advance. The bound the online policies are judged against
// (`moe replay-trace`, docs/memory-islands.md); never used while serving.

#include <cstdint>
#include <string>
#include <vector>

#include "residency/eviction_policy.h"

namespace moe {

// The map's acquires must follow `sequence` exactly.
class BeladyPolicy final : public EvictionPolicy {
 public:
  explicit BeladyPolicy(std::vector<ExpertKey> sequence);
  std::string name() const override { return "belady"; }
  void attach(int n_layers, int n_experts) override;
  void on_access(ExpertKey key, uint64_t now) override;
  double keep_score(ExpertKey key, uint64_t now) const override;

 private:
  std::vector<ExpertKey> seq_;
  std::vector<uint64_t> next_of_;   // [position] next position of the same key, or kNever
  std::vector<uint64_t> next_use_;  // [key] next position where the key is used
  uint64_t pos_ = 0;                // acquires seen
  int n_experts_ = 0;
};

}  // namespace moe
