#include "gateway/structured/grammar_vocabulary.h"

#include <algorithm>
#include <numeric>
#include <unordered_set>

namespace moe::gw::structured {

namespace {

// Well-formed UTF-8 with no quote, backslash or control byte.
bool plain_text(const std::string& s) {
  size_t i = 0;
  while (i < s.size()) {
    const uint8_t b = uint8_t(s[i]);
    if (b < 0x20 || b == '"' || b == '\\') return false;
    int more = 0;
    uint8_t lo = 0x80, hi = 0xBF;
    if (b < 0x80) {
      more = 0;
    } else if (b >= 0xC2 && b <= 0xDF) {
      more = 1;
    } else if (b >= 0xE0 && b <= 0xEF) {
      more = 2;
      if (b == 0xE0) lo = 0xA0;
      if (b == 0xED) hi = 0x9F;
    } else if (b >= 0xF0 && b <= 0xF4) {
      more = 3;
      if (b == 0xF0) lo = 0x90;
      if (b == 0xF4) hi = 0x8F;
    } else {
      return false;
    }
    ++i;
    for (int k = 0; k < more; ++k, ++i) {
      if (i >= s.size()) return false;
      const uint8_t c = uint8_t(s[i]);
      if (c < lo || c > hi) return false;
      lo = 0x80;
      hi = 0xBF;
    }
  }
  return true;
}

}  // namespace

// `ids` sorted by bytes: sorted strings share prefixes with their
// predecessor, so a stack of the open path, closed (its subtree's end known)
// as the next string leaves it, builds the preorder trie in one pass.
void GrammarVocabulary::build_trie(const GrammarVocabulary& v, const std::vector<int32_t>& ids, Trie* t) {
  std::vector<uint32_t> path;
  const std::string* prev = nullptr;
  for (int32_t id : ids) {
    const std::string& s = v.bytes_[size_t(id)];
    size_t common = 0;
    if (prev)
      while (common < prev->size() && common < s.size() && (*prev)[common] == s[common]) ++common;
    while (path.size() > common) {
      t->nodes[path.back()].end = uint32_t(t->nodes.size());
      path.pop_back();
    }
    for (size_t k = common; k < s.size(); ++k) {
      Node n;
      n.byte = uint8_t(s[k]);
      n.depth = uint8_t(k + 1);
      path.push_back(uint32_t(t->nodes.size()));
      t->nodes.push_back(n);
    }
    Node& last = t->nodes[path.back()];
    if (last.tokens_begin == last.tokens_end) last.tokens_begin = last.tokens_end = uint32_t(t->tokens.size());
    t->tokens.push_back(id);
    last.tokens_end = uint32_t(t->tokens.size());
    prev = &s;
  }
  while (!path.empty()) {
    t->nodes[path.back()].end = uint32_t(t->nodes.size());
    path.pop_back();
  }
}

std::shared_ptr<const GrammarVocabulary> GrammarVocabulary::build(const TextCodec& codec) {
  auto v = std::make_shared<GrammarVocabulary>();
  v->vocab_ = codec.vocab_size();
  v->bytes_.resize(size_t(v->vocab_));
  const std::vector<int32_t> stops = codec.stop_token_ids();
  const std::unordered_set<int32_t> stop(stops.begin(), stops.end());
  std::vector<int32_t> ids;
  for (int32_t id = 0; id < v->vocab_; ++id) {
    if (stop.count(id) || codec.is_special(id)) continue;
    // The token's own bytes: a byte token that is part of a character is
    // that byte (the grammar checks UTF-8 byte by byte), not U+FFFD, so a
    // character the vocabulary has no whole token for is still spelled.
    std::string b = codec.token_raw_bytes(id);
    if (b.empty() || b.size() > 255) continue;
    v->bytes_[size_t(id)] = std::move(b);
    ids.push_back(id);
  }
  std::sort(ids.begin(), ids.end(), [&](int32_t a, int32_t b) {
    return v->bytes_[size_t(a)] != v->bytes_[size_t(b)] ? v->bytes_[size_t(a)] < v->bytes_[size_t(b)] : a < b;
  });
  v->plain_.assign(size_t(v->vocab_ + 31) / 32, 0u);
  std::vector<int32_t> not_plain;
  for (int32_t id : ids) {
    if (plain_text(v->bytes_[size_t(id)]))
      v->plain_[size_t(id) / 32] |= 1u << (id % 32);
    else
      not_plain.push_back(id);
  }
  build_trie(*v, ids, &v->all_);
  build_trie(*v, not_plain, &v->not_plain_);
  for (int32_t id : ids) v->max_depth_ = std::max(v->max_depth_, int(v->bytes_[size_t(id)].size()));
  return v;
}

}  // namespace moe::gw::structured
