#include "tokenizer/bpe_model.h"

#include <algorithm>
#include <cstdio>
#include <mutex>
#include <queue>

#include "tokenizer/utf8.h"

namespace moe::tok {

namespace {
constexpr size_t kCacheMaxWords = 1 << 16;
constexpr size_t kCacheMaxWordBytes = 256;
}  // namespace

Result<std::unique_ptr<BpeModel>> BpeModel::from_json(const nlohmann::json& model) {
  if (!model.is_object()) return make_error("model: not an object");
  if (model.value("type", "BPE") != "BPE")
    return make_error("model type '" + model.value("type", "") + "' is not supported (only BPE)");
  auto m = std::unique_ptr<BpeModel>(new BpeModel());
  const auto& vocab = model.value("vocab", nlohmann::json::object());
  if (!vocab.is_object() || vocab.empty()) return make_error("model: empty or missing vocab");
  int32_t max_id = -1;
  for (const auto& [tok, id] : vocab.items()) {
    // Ids index a table of tokens: one far past any real vocabulary would
    // allocate it (a billion entries) before anything else is checked.
    if (!id.is_number_integer() || id.get<int64_t>() < 0 || id.get<int64_t>() > kMaxTokenId)
      return make_error("model: the id of '" + tok.substr(0, 64) + "' is " + id.dump().substr(0, 32) +
                        ", not an integer from 0 to " + std::to_string(kMaxTokenId));
    const int32_t i = id.get<int32_t>();
    m->vocab_.emplace(tok, i);
    max_id = std::max(max_id, i);
  }
  m->tokens_.resize(static_cast<size_t>(max_id) + 1);
  for (const auto& [tok, id] : m->vocab_) m->tokens_[static_cast<size_t>(id)] = tok;

  auto opt_string = [&](const char* key) {
    return model.contains(key) && model[key].is_string() ? model[key].get<std::string>()
                                                         : std::string();
  };
  m->subword_prefix_ = opt_string("continuing_subword_prefix");
  m->word_suffix_ = opt_string("end_of_word_suffix");
  const std::string unk = opt_string("unk_token");
  if (!unk.empty()) m->unk_id_ = m->token_to_id(unk);
  m->fuse_unk_ = model.value("fuse_unk", false) == true;
  m->byte_fallback_ = model.contains("byte_fallback") && model["byte_fallback"].is_boolean() &&
                      model["byte_fallback"].get<bool>();
  m->ignore_merges_ = model.contains("ignore_merges") && model["ignore_merges"].is_boolean() &&
                      model["ignore_merges"].get<bool>();
  for (int b = 0; b < 256; ++b) {
    char name[8];
    std::snprintf(name, sizeof(name), "<0x%02X>", b);
    m->byte_ids_[static_cast<size_t>(b)] = m->token_to_id(name);
  }

  // Merges: "a b" strings (older files) or [a, b] pairs. Their rank is
  // their place in the list, or, where "merge_ranks" gives one per merge
  // (our own key: a GGUF SentencePiece vocabulary ranks its merges by the
  // merged piece's score, equal scores tying, docs/gguf.md), that.
  const auto& merges = model.value("merges", nlohmann::json::array());
  const auto& ranks = model.value("merge_ranks", nlohmann::json::array());
  if (!ranks.empty() && ranks.size() != merges.size())
    return make_error("model: merge_ranks has " + std::to_string(ranks.size()) + " entries for " +
                      std::to_string(merges.size()) + " merges");
  int32_t rank = 0;
  for (const auto& mg : merges) {
    std::string a, b;
    if (mg.is_string()) {
      const std::string s = mg.get<std::string>();
      const size_t sp = s.find(' ', 1);
      if (sp == std::string::npos) return make_error("model: bad merge '" + s + "'");
      a = s.substr(0, sp);
      b = s.substr(sp + 1);
    } else if (mg.is_array() && mg.size() == 2) {
      a = mg[0].get<std::string>();
      b = mg[1].get<std::string>();
    } else {
      return make_error("model: bad merge entry " + mg.dump());
    }
    const int32_t ia = m->token_to_id(a), ib = m->token_to_id(b);
    if (ia < 0 || ib < 0)
      return make_error("model: merge '" + a + " " + b + "' uses a token not in the vocab");
    std::string joined = a;
    joined += std::string_view(b).substr(
        !m->subword_prefix_.empty() && b.starts_with(m->subword_prefix_) ? m->subword_prefix_.size()
                                                                         : 0);
    const int32_t inew = m->token_to_id(joined);
    if (inew < 0) return make_error("model: merge result '" + joined + "' not in the vocab");
    const int32_t r = ranks.empty() ? rank : ranks[size_t(rank)].get<int32_t>();
    ++rank;
    m->merges_.emplace(pair_key(ia, ib), Merge{r, inew});
  }
  return m;
}

int32_t BpeModel::token_to_id(std::string_view token) const {
  auto it = vocab_.find(token);
  return it == vocab_.end() ? -1 : it->second;
}

const std::string* BpeModel::id_to_token(int32_t id) const {
  if (id < 0 || static_cast<size_t>(id) >= tokens_.size() ||
      tokens_[static_cast<size_t>(id)].empty())
    return nullptr;
  return &tokens_[static_cast<size_t>(id)];
}

void BpeModel::encode_word(std::string_view word, std::vector<int32_t>& out) const {
  if (word.empty()) return;
  const bool cacheable = word.size() <= kCacheMaxWordBytes;
  if (cacheable) {
    std::shared_lock lock(cache_mu_);
    auto it = cache_.find(word);
    if (it != cache_.end()) {
      out.insert(out.end(), it->second.begin(), it->second.end());
      return;
    }
  }
  const size_t start = out.size();
  merge_word(word, out);
  if (cacheable) {
    std::unique_lock lock(cache_mu_);
    if (cache_.size() < kCacheMaxWords)
      cache_.emplace(
          std::string(word),
          std::vector<int32_t>(out.begin() + static_cast<std::ptrdiff_t>(start), out.end()));
  }
}

void BpeModel::merge_word(std::string_view word, std::vector<int32_t>& out) const {
  if (ignore_merges_ && subword_prefix_.empty() && word_suffix_.empty()) {
    const int32_t id = token_to_id(word);
    if (id >= 0) {
      out.push_back(id);
      return;
    }
  }

  // One symbol per character (or per byte with byte fallback), as a doubly
  // linked list so that merges are O(1); a dead symbol has id -1.
  struct Symbol {
    int32_t id;
    int32_t prev, next;
  };
  std::vector<Symbol> sym;
  sym.reserve(word.size());
  auto push = [&](int32_t id) {
    const auto n = static_cast<int32_t>(sym.size());
    sym.push_back({id, n - 1, n + 1});
  };
  std::string piece;
  for (size_t i = 0; i < word.size();) {
    size_t n = utf8_char_len(word, i);
    if (n == 0) n = 1;
    const std::string_view ch = word.substr(i, n);
    const bool first = i == 0, last = i + n == word.size();
    i += n;
    int32_t id;
    if ((first || subword_prefix_.empty()) && (!last || word_suffix_.empty())) {
      id = token_to_id(ch);
    } else {
      piece.clear();
      if (!first) piece += subword_prefix_;
      piece += ch;
      if (last) piece += word_suffix_;
      id = token_to_id(piece);
    }
    if (id >= 0) {
      push(id);
      continue;
    }
    if (byte_fallback_) {
      bool all = true;
      for (char c : ch) all = all && byte_ids_[static_cast<uint8_t>(c)] >= 0;
      if (all) {
        for (char c : ch) push(byte_ids_[static_cast<uint8_t>(c)]);
        continue;
      }
    }
    if (unk_id_ >= 0) {
      if (fuse_unk_ && !sym.empty() && sym.back().id == unk_id_) continue;
      push(unk_id_);
    }
  }
  if (sym.empty()) return;
  sym.back().next = -1;

  // Lowest rank first; among equal ranks, the leftmost pair.
  struct Cand {
    int32_t rank, pos, new_id;
    bool operator>(const Cand& o) const { return rank != o.rank ? rank > o.rank : pos > o.pos; }
  };
  std::priority_queue<Cand, std::vector<Cand>, std::greater<Cand>> queue;
  auto consider = [&](int32_t pos) {
    if (pos < 0) return;
    const int32_t nx = sym[static_cast<size_t>(pos)].next;
    if (nx < 0) return;
    auto it =
        merges_.find(pair_key(sym[static_cast<size_t>(pos)].id, sym[static_cast<size_t>(nx)].id));
    if (it != merges_.end()) queue.push({it->second.rank, pos, it->second.new_id});
  };
  if (!merges_.empty())
    for (int32_t p = 0; p + 1 < static_cast<int32_t>(sym.size()); ++p) consider(p);
  while (!queue.empty()) {
    const Cand c = queue.top();
    queue.pop();
    Symbol& left = sym[static_cast<size_t>(c.pos)];
    if (left.id < 0 || left.next < 0) continue;
    Symbol& right = sym[static_cast<size_t>(left.next)];
    // Stale entry: the pair at pos changed since it was queued.
    auto it = merges_.find(pair_key(left.id, right.id));
    if (it == merges_.end() || it->second.rank != c.rank || it->second.new_id != c.new_id) continue;
    left.id = c.new_id;
    right.id = -1;
    left.next = right.next;
    if (right.next >= 0) sym[static_cast<size_t>(right.next)].prev = c.pos;
    consider(left.prev);
    consider(c.pos);
  }
  for (int32_t p = 0; p >= 0; p = sym[static_cast<size_t>(p)].next)
    out.push_back(sym[static_cast<size_t>(p)].id);
}

}  // namespace moe::tok
