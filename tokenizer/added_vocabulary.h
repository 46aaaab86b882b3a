#pragma once
// Added tokens (tokenizer.json "added_tokens"): strings matched in the text
// before normalisation and pre-tokenisation, longest first at the leftmost
// position, each becoming exactly one id. Tokens with normalized=false are
// matched in the raw text; normalized=true ones in the normalised text.

#include <cstdint>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace moe::tok {

struct AddedToken {
  std::string content;
  int32_t id = -1;
  bool special = false;
  bool single_word = false;  // only where not inside a word
  bool lstrip = false;       // swallows white space on its left
  bool rstrip = false;       // swallows white space on its right
  bool normalized = false;   // matched after normalisation
};

// A cut of the text: either an added token (id >= 0) or plain text.
struct Segment {
  std::string_view text;
  int32_t id = -1;
};

class AddedMatcher {
 public:
  // tokens: those matched at this stage; content is what is searched for.
  explicit AddedMatcher(std::vector<AddedToken> tokens);
  bool empty() const { return tokens_.empty(); }
  // Cuts text into plain and added-token segments, in order; plain segments
  // may be empty only when text is.
  void split(std::string_view text, std::vector<Segment>& out) const;

 private:
  std::vector<AddedToken> tokens_;
  std::vector<std::vector<uint32_t>> by_first_byte_;  // [256] -> indices, longest first
};

}  // namespace moe::tok
