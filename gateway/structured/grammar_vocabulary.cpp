#include "gateway/structured/grammar_vocabulary.h"

#include <algorithm>
#include <numeric>
#include <unordered_set>

namespace moe::gw::structured {

std::shared_ptr<const GrammarVocabulary> GrammarVocabulary::build(const TextCodec& codec) {
  auto v = std::make_shared<GrammarVocabulary>();
  v->vocab_ = codec.vocab_size();
  v->bytes_.resize(size_t(v->vocab_));
  const std::vector<int32_t> stops = codec.stop_token_ids();
  const std::unordered_set<int32_t> stop(stops.begin(), stops.end());
  std::vector<int32_t> ids;
  for (int32_t id = 0; id < v->vocab_; ++id) {
    if (stop.count(id) || codec.is_special(id)) continue;
    std::string b = codec.token_bytes(id);
    if (b.empty() || b.size() > 255) continue;
    v->bytes_[size_t(id)] = std::move(b);
    ids.push_back(id);
  }
  std::sort(ids.begin(), ids.end(), [&](int32_t a, int32_t b) {
    return v->bytes_[size_t(a)] != v->bytes_[size_t(b)] ? v->bytes_[size_t(a)] < v->bytes_[size_t(b)] : a < b;
  });
  // Sorted strings share prefixes with their predecessor: a stack of the
  // open path, closed (its subtree's end known) as the next string leaves it.
  std::vector<uint32_t> path;
  const std::string* prev = nullptr;
  for (int32_t id : ids) {
    const std::string& s = v->bytes_[size_t(id)];
    size_t common = 0;
    if (prev)
      while (common < prev->size() && common < s.size() && (*prev)[common] == s[common]) ++common;
    while (path.size() > common) {
      v->nodes_[path.back()].end = uint32_t(v->nodes_.size());
      path.pop_back();
    }
    for (size_t k = common; k < s.size(); ++k) {
      Node n;
      n.byte = uint8_t(s[k]);
      n.depth = uint8_t(k + 1);
      path.push_back(uint32_t(v->nodes_.size()));
      v->nodes_.push_back(n);
    }
    Node& last = v->nodes_[path.back()];
    if (last.tokens_begin == last.tokens_end) last.tokens_begin = last.tokens_end = uint32_t(v->tokens_.size());
    v->tokens_.push_back(id);
    last.tokens_end = uint32_t(v->tokens_.size());
    v->max_depth_ = std::max(v->max_depth_, int(s.size()));
    prev = &s;
  }
  while (!path.empty()) {
    v->nodes_[path.back()].end = uint32_t(v->nodes_.size());
    path.pop_back();
  }
  return v;
}

}  // namespace moe::gw::structured
