#pragma once
// Pre-tokenisers of tokenizer.json ("pre_tokenizer"): Split (regex or string,
// with its behaviour and invert flag), ByteLevel (GPT-2 regex + byte
// alphabet), Metaspace, Sequence. Each one refines a list of pieces; the BPE
// model then runs on every final piece on its own.

#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "model/result.h"

namespace moe::tok {

class PreTokenizer {
 public:
  virtual ~PreTokenizer() = default;
  // Replaces pieces by their refinement; empty pieces are dropped.
  // at_text_start: the first piece begins the whole input (Metaspace
  // prepend_scheme "first" only prepends there).
  virtual void pre_tokenize(std::vector<std::string>& pieces, bool at_text_start) const = 0;
};

// A null spec gives a null pointer (the whole piece is one word).
Result<std::unique_ptr<PreTokenizer>> make_pre_tokenizer(const nlohmann::json& spec);

// How matches of a Split pattern become pieces.
enum class SplitBehavior { kRemoved, kIsolated, kMergedWithPrevious, kMergedWithNext, kContiguous };

// Cuts text by the [begin, end) match ranges (sorted, non-overlapping) the way
// the Split pre-tokeniser does, appending non-empty pieces to out.
void split_by_matches(const std::string& text,
                      const std::vector<std::pair<size_t, size_t>>& matches, SplitBehavior behavior,
                      bool invert, std::vector<std::string>& out);

}  // namespace moe::tok
