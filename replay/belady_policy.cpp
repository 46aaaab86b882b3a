#include "replay/belady_policy.h"

#include <limits>

namespace moe {

namespace {
constexpr uint64_t kNever = std::numeric_limits<uint64_t>::max();
size_t index_of(ExpertKey k, int n_experts) { return size_t(k.layer) * size_t(n_experts) + size_t(k.expert); }
}  // namespace

BeladyPolicy::BeladyPolicy(std::vector<ExpertKey> sequence) : seq_(std::move(sequence)) {}

void BeladyPolicy::attach(int n_layers, int n_experts) {
  n_experts_ = n_experts;
  const size_t n = size_t(n_layers) * size_t(n_experts);
  next_use_.assign(n, kNever);
  next_of_.assign(seq_.size(), kNever);
  for (size_t p = seq_.size(); p-- > 0;) {  // walk backwards: next_use_ holds the following use
    const size_t i = index_of(seq_[p], n_experts_);
    next_of_[p] = next_use_[i];
    next_use_[i] = p;
  }
  pos_ = 0;
}

void BeladyPolicy::on_access(ExpertKey key, uint64_t) {
  const size_t i = index_of(key, n_experts_);
  if (pos_ < seq_.size() && seq_[pos_] == key) next_use_[i] = next_of_[pos_];
  ++pos_;
}

double BeladyPolicy::keep_score(ExpertKey key, uint64_t) const {
  const uint64_t nu = next_use_[index_of(key, n_experts_)];
  return nu == kNever ? -std::numeric_limits<double>::max() : -double(nu);
}

}  // namespace moe
