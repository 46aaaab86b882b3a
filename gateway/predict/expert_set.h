#pragma once
// A set of (MoE layer, expert) pairs as a bitset over [layer * n_experts +
// expert]: what a prompt is predicted to use, what a step already touches,
// what a worker holds resident. Overlaps are popcounts.

#include <bit>
#include <cstddef>
#include <cstdint>
#include <vector>

namespace moe::gw {

class ExpertSet {
 public:
  ExpertSet() = default;
  explicit ExpertSet(size_t n) : words_((n + 63) / 64, 0) {}

  bool empty() const { return count() == 0; }
  void add(size_t i) {
    if (i / 64 >= words_.size()) words_.resize(i / 64 + 1, 0);
    words_[i / 64] |= uint64_t(1) << (i % 64);
  }
  bool has(size_t i) const { return i / 64 < words_.size() && (words_[i / 64] >> (i % 64)) & 1; }
  size_t count() const {
    size_t n = 0;
    for (uint64_t w : words_) n += size_t(std::popcount(w));
    return n;
  }
  size_t overlap(const ExpertSet& o) const {
    size_t n = 0;
    for (size_t i = 0; i < words_.size() && i < o.words_.size(); ++i)
      n += size_t(std::popcount(words_[i] & o.words_[i]));
    return n;
  }
  void merge(const ExpertSet& o) {
    if (o.words_.size() > words_.size()) words_.resize(o.words_.size(), 0);
    for (size_t i = 0; i < o.words_.size(); ++i) words_[i] |= o.words_[i];
  }
  void clear() { words_.assign(words_.size(), 0); }

 private:
  std::vector<uint64_t> words_;
};

}  // namespace moe::gw
