#pragma once
// A tokenizer's tokens as bytes, for constrained decoding: a trie in
// preorder, so one pass over an array walks it and a dead state skips a
// whole subtree (token_grammar.h). Special tokens, the stop ids and tokens
// longer than 255 bytes are left out: no grammar allows them (the stop ids
// are added where a value may end).

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "gateway/api/text_codec.h"

namespace moe::gw::structured {

class GrammarVocabulary {
 public:
  struct Node {
    uint8_t byte = 0;
    uint8_t depth = 0;       // 1 for a token's first byte
    uint32_t end = 0;        // one past the last node of this node's subtree
    uint32_t tokens_begin = 0, tokens_end = 0;  // tokens whose bytes end here (into tokens())
  };

  static std::shared_ptr<const GrammarVocabulary> build(const TextCodec& codec);

  struct Trie {
    std::vector<Node> nodes;
    std::vector<int32_t> tokens;
  };
  // Every token left in, and those that are not plain string text.
  const Trie& all() const { return all_; }
  const Trie& not_plain() const { return not_plain_; }
  // Plain string text: well-formed UTF-8 without a quote, backslash or
  // control byte (inside a string any of these keeps the state), as a mask.
  const std::vector<uint32_t>& plain() const { return plain_; }
  const std::vector<Node>& nodes() const { return all_.nodes; }
  const std::vector<int32_t>& tokens() const { return all_.tokens; }
  int vocab_size() const { return vocab_; }
  int max_depth() const { return max_depth_; }
  // The bytes of token `id` ("" for one left out).
  const std::string& bytes(int32_t id) const { return bytes_[size_t(id)]; }

 private:
  Trie all_, not_plain_;
  std::vector<uint32_t> plain_;
  std::vector<std::string> bytes_;
  int vocab_ = 0;
  int max_depth_ = 0;
  static void build_trie(const GrammarVocabulary& v, const std::vector<int32_t>& ids, Trie* t);
};

}  // namespace moe::gw::structured
