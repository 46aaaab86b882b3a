#pragma once
// A byte-level recogniser of JSON text that validates against a compiled
// schema (json_schema.h): a pushdown automaton whose state is a small set of
// stacks (alternatives of anyOf run side by side). Value semantics: copying
// a state is copying a few frames, which is what the token mask's walk over
// the vocabulary does at every trie node (token_mask.h).

#include <array>
#include <cstdint>
#include <string>
#include <string_view>

#include "gateway/structured/json_schema.h"

namespace moe::gw::structured {

inline constexpr int kMaxDepth = 16;        // frames per stack: nesting of objects and arrays
inline constexpr int kMaxStacks = 8;        // alternatives alive at once
inline constexpr int kMaxIndent = 32;       // spaces after a newline between tokens (else at most one space)
inline constexpr int kMaxDigits = 24;       // digits of a number's integer or fraction part (integers: 18; exponents: 2)

struct Frame {
  uint16_t node = 0;
  uint8_t kind = 0;
  uint8_t stage = 0;
  uint8_t ws = 0;    // whitespace run so far
  uint8_t aux = 0;   // digits, hex digits, or the property just named (255: another)
  uint16_t pos = 0;  // bytes of a key or literal matched; items of an array
  uint64_t bits = 0; // properties seen (object), names still matching (key), literals still matching
};
static_assert(sizeof(Frame) == 16);

struct Stack {
  uint8_t depth = 0;
  std::array<Frame, kMaxDepth> f;
  bool operator==(const Stack& o) const;
};

// The fewest frames a stack needs to complete a value of `node` (each
// object, key, array and value a frame; an alternative its cheapest
// option), at most kMaxDepth + 1: above kMaxDepth no output can complete it
// (a required nesting too deep, or a required recursion without end).
int frames_needed(const Schema& schema, int node);

class GrammarState {
 public:
  GrammarState() = default;
  // Before the first byte of a value of `schema`'s root.
  static GrammarState start(const Schema& schema);

  // The state after one more byte; empty() when the byte cannot come next.
  void feed(const Schema& schema, uint8_t byte, GrammarState* out) const;
  // Feeds every byte; false (and an empty state) when one is refused.
  bool feed(const Schema& schema, std::string_view bytes);

  bool empty() const { return n_ == 0; }
  // The text so far is a whole value (end of output allowed here).
  bool finishable(const Schema& schema) const;
  // A whole value to which nothing more can be added.
  bool closed() const;
  // Every alternative is inside a string, between characters: any text
  // without a quote, backslash or control byte keeps it so.
  bool in_string_content() const;
  // What identifies the state (for caches): the stacks' bytes, in order.
  std::string key() const;

  // A stack alive after a byte (the recogniser's steps; identical ones once).
  void add(const Stack& s);

 private:
  int n_ = 0;
  std::array<Stack, kMaxStacks> s_;
};

}  // namespace moe::gw::structured
