#pragma once
// A compiled PCRE2 pattern (UTF + Unicode properties, JIT when available),
// used by the Split pre-tokenizer and the Replace normaliser/decoder.
// Immutable after compile(): safe to share between threads.

#include <cstddef>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "model/result.h"

namespace moe::tok {

class Regex {
 public:
  static Result<std::shared_ptr<const Regex>> compile(std::string_view pattern);
  ~Regex();
  Regex(const Regex&) = delete;
  Regex& operator=(const Regex&) = delete;

  // Appends the [begin, end) byte ranges of the non-empty matches in text,
  // left to right and non-overlapping. text must be valid UTF-8.
  void find_all(std::string_view text, std::vector<std::pair<size_t, size_t>>& out) const;

 private:
  Regex(void* code, bool jit) : code_(code), jit_(jit) {}
  void* code_;  // pcre2_code_8*
  bool jit_;    // compiled to machine code
};

}  // namespace moe::tok
