#pragma once
// A compiled schema over one vocabulary: which tokens may come next in a
// grammar state (docs/structured-output.md). GrammarRegistry owns the
// vocabulary trie (built on first use), one TokenGrammar per schema text,
// and one cache of masks keyed by (grammar, state) under a byte budget.
// Everything here runs on the gateway's loop thread.

#include <cstdint>
#include <list>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "gateway/structured/grammar_vocabulary.h"
#include "gateway/structured/json_grammar.h"
#include "gateway/structured/json_schema.h"

namespace moe::gw::structured {

using TokenMask = std::vector<uint32_t>;  // bit t % 32 of word t / 32: token t allowed

class GrammarRegistry;

class TokenGrammar {
 public:
  const Schema& schema() const { return *schema_; }
  const GrammarVocabulary& vocabulary() const { return *vocab_; }
  GrammarState start() const { return GrammarState::start(*schema_); }
  // The tokens whose bytes the grammar accepts from `state` (the stop ids
  // not included: the caller adds them where state.finishable()).
  std::shared_ptr<const TokenMask> mask(const GrammarState& state) const;

 private:
  friend class GrammarRegistry;
  std::shared_ptr<const Schema> schema_;
  std::shared_ptr<const GrammarVocabulary> vocab_;
  GrammarRegistry* registry_ = nullptr;
  uint64_t serial_ = 0;
  size_t bytes_ = 0;  // schema_bytes(*schema_), counted while the registry keeps it
};

// What a compiled schema holds in memory, roughly (its nodes, names,
// literals and canonical text).
size_t schema_bytes(const Schema& schema);

// The walk itself (no cache): for tests and the registry.
TokenMask compute_mask(const Schema& schema, const GrammarVocabulary& vocab, const GrammarState& state);

class GrammarRegistry {
 public:
  // Builds the vocabulary's trie now (tens of milliseconds for 150,000
  // tokens), so that no request waits for it.
  explicit GrammarRegistry(const TextCodec* codec, size_t cache_bytes = size_t(256) << 20);

  std::shared_ptr<const TokenGrammar> grammar(std::shared_ptr<const Schema> schema);

  struct Stats {
    uint64_t masks_computed = 0, mask_hits = 0;
    double compute_seconds = 0;
    size_t cache_bytes = 0;
  };
  const Stats& stats() const { return stats_; }

 private:
  friend class TokenGrammar;
  std::shared_ptr<const TokenMask> lookup(uint64_t serial, const TokenGrammar& g, const GrammarState& state);

  const TextCodec* codec_;
  std::shared_ptr<const GrammarVocabulary> vocab_;
  // The most recently used schemas' grammars (their masks stay useful to
  // the next request of the same schema), at most kMaxGrammars and
  // kGrammarBytes of schemas (by schema_bytes; the newest is always kept).
  static constexpr size_t kMaxGrammars = 64;
  static constexpr size_t kGrammarBytes = size_t(64) << 20;
  size_t grammar_bytes_ = 0;
  std::list<std::shared_ptr<const TokenGrammar>> grammars_;
  uint64_t next_serial_ = 1;
  // LRU of masks: most recent at the front.
  struct Entry {
    std::string key;
    std::shared_ptr<const TokenMask> mask;
  };
  std::list<Entry> lru_;
  std::unordered_map<std::string, std::list<Entry>::iterator> index_;
  size_t cache_budget_, cache_used_ = 0;
  Stats stats_;
};

}  // namespace moe::gw::structured
