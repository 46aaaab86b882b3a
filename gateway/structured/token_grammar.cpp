#include "gateway/structured/token_grammar.h"

#include <chrono>
#include <cstdio>

namespace moe::gw::structured {

TokenMask compute_mask(const Schema& schema, const GrammarVocabulary& vocab, const GrammarState& state) {
  TokenMask mask(size_t(vocab.vocab_size() + 31) / 32, 0u);
  // Inside a string every plain-text token keeps the state: only the others
  // need the walk (a few percent of a vocabulary).
  const bool in_string = state.in_string_content();
  if (in_string) mask = vocab.plain();
  const GrammarVocabulary::Trie& trie = in_string ? vocab.not_plain() : vocab.all();
  const auto& nodes = trie.nodes;
  const auto& tokens = trie.tokens;
  // states[d]: after the first d bytes of the current path.
  std::vector<GrammarState> states(size_t(vocab.max_depth()) + 1);
  states[0] = state;
  for (size_t i = 0; i < nodes.size();) {
    const GrammarVocabulary::Node& n = nodes[i];
    GrammarState& here = states[n.depth];
    states[size_t(n.depth) - 1].feed(schema, n.byte, &here);
    if (here.empty()) {
      i = n.end;  // no token under this prefix can come
      continue;
    }
    for (uint32_t k = n.tokens_begin; k < n.tokens_end; ++k) mask[size_t(tokens[k]) / 32] |= 1u << (tokens[k] % 32);
    ++i;
  }
  return mask;
}

size_t schema_bytes(const Schema& schema) {
  size_t b = sizeof(Schema) + schema.key.capacity() + schema.nodes.capacity() * sizeof(SchemaNode);
  for (const SchemaNode& n : schema.nodes) {
    b += (n.props.capacity() + n.options.capacity()) * sizeof(int);
    for (const std::string& x : n.names) b += sizeof(std::string) + x.capacity();
    for (const std::string& x : n.literals) b += sizeof(std::string) + x.capacity();
  }
  return b;
}

std::shared_ptr<const TokenMask> TokenGrammar::mask(const GrammarState& state) const {
  return registry_->lookup(serial_, *this, state);
}

GrammarRegistry::GrammarRegistry(const TextCodec* codec, size_t cache_bytes) : codec_(codec), cache_budget_(cache_bytes) {
  if (codec_) {
    const auto t0 = std::chrono::steady_clock::now();
    vocab_ = GrammarVocabulary::build(*codec_);
    std::fprintf(stderr,
                 "moe-gateway: structured output: the vocabulary's %zu tokens as a trie of %zu nodes, %zu of them not "
                 "plain string text (%.0f ms)\n",
                 vocab_->tokens().size(), vocab_->nodes().size(), vocab_->not_plain().tokens.size(),
                 std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
  }
}

std::shared_ptr<const TokenGrammar> GrammarRegistry::grammar(std::shared_ptr<const Schema> schema) {
  for (auto it = grammars_.begin(); it != grammars_.end(); ++it)
    if ((*it)->schema().key == schema->key) {
      grammars_.splice(grammars_.begin(), grammars_, it);
      return grammars_.front();
    }
  auto g = std::shared_ptr<TokenGrammar>(new TokenGrammar());
  g->schema_ = std::move(schema);
  g->vocab_ = vocab_;
  g->registry_ = this;
  g->serial_ = next_serial_++;
  g->bytes_ = schema_bytes(g->schema());
  grammars_.push_front(g);
  grammar_bytes_ += g->bytes_;
  // The least recently used go (requests still holding one keep it; its masks age out of the LRU).
  while (grammars_.size() > 1 && (grammars_.size() > kMaxGrammars || grammar_bytes_ > kGrammarBytes)) {
    grammar_bytes_ -= grammars_.back()->bytes_;
    grammars_.pop_back();
  }
  return g;
}

std::shared_ptr<const TokenMask> GrammarRegistry::lookup(uint64_t serial, const TokenGrammar& g, const GrammarState& state) {
  std::string key = std::to_string(serial) + ':' + state.key();
  if (auto it = index_.find(key); it != index_.end()) {
    lru_.splice(lru_.begin(), lru_, it->second);
    ++stats_.mask_hits;
    return it->second->mask;
  }
  const auto t0 = std::chrono::steady_clock::now();
  auto mask = std::make_shared<const TokenMask>(compute_mask(g.schema(), g.vocabulary(), state));
  stats_.compute_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  ++stats_.masks_computed;
  const size_t bytes = mask->size() * 4 + key.size() + 64;
  while (!lru_.empty() && cache_used_ + bytes > cache_budget_) {
    const Entry& old = lru_.back();
    cache_used_ -= old.mask->size() * 4 + old.key.size() + 64;
    index_.erase(old.key);
    lru_.pop_back();
  }
  lru_.push_front({key, mask});
  index_[std::move(key)] = lru_.begin();
  cache_used_ += bytes;
  stats_.cache_bytes = cache_used_;
  return mask;
}

}  // namespace moe::gw::structured
