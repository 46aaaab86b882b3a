#pragma once
// Tokenizer: a byte-for-byte reimplementation of what a `tokenizer.json`
// (BPE model) describes, so that the ids we feed the model are the ids the
// model was trained on.
//
// Pipeline of encode(): added tokens are split out of the raw text first
// (longest first; special tokens are recognised even when add_special_tokens
// is false, as the reference does), then each remaining piece is normalised,
// pre-tokenised into words, and each word is run through the BPE merges.
// add_special_tokens=true then applies the post-processor (e.g. BOS).
//
// Bad input never fails and never crashes:
//  - invalid UTF-8 in the text given to encode() is replaced first, each
//    maximal invalid subsequence by one U+FFFD (as a lossy UTF-8 decoder
//    does), and the result is encoded;
//  - a NUL byte is an ordinary character and encodes like any other byte;
//  - decode() of an id outside the vocabulary skips that id; bytes that do not
//    form valid UTF-8 after decoding come out as U+FFFD.
// Thread safety: every const method may be called from many threads at once.

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "model/result.h"

namespace moe {

class Tokenizer {
 public:
  // tokenizer_config_json may be empty; it supplies bos/eos token names.
  static Result<std::unique_ptr<Tokenizer>> from_json(std::string_view tokenizer_json,
                                                      std::string_view tokenizer_config_json);
  // Reads dir/tokenizer.json and, when present, dir/tokenizer_config.json.
  static Result<std::unique_ptr<Tokenizer>> load_dir(const std::string& dir);
  ~Tokenizer();

  std::vector<int32_t> encode(std::string_view text, bool add_special_tokens) const;
  // A part of a longer input, no post-processing. `specials` false: a
  // special token's characters are only characters (what a chat message
  // says; transformers' split_special_tokens), other added tokens still
  // match. `at_text_start`: the part begins the input (a Metaspace
  // pre-tokeniser's "first" prefix).
  std::vector<int32_t> encode_part(std::string_view text, bool specials, bool at_text_start) const;
  // Whether a special token's text appears in `text` (one pass of the
  // added tokens' matcher, not one scan a token).
  bool has_special_text(std::string_view text) const;
  std::string decode(std::span<const int32_t> ids, bool skip_special_tokens) const;
  // The bytes one token stands for, as the decoder gives them but with
  // broken UTF-8 left as it is (a byte token is one byte of a character);
  // no clean-up of spaces. decode() of the same id repairs those to U+FFFD.
  std::string token_bytes(int32_t id) const;

  int32_t token_to_id(std::string_view token) const;  // -1 if none
  std::string id_to_token(int32_t id) const;          // "" if none
  int vocab_size() const;  // one more than the largest id (model vocab or added token)

  const std::string& bos_token() const { return bos_token_; }  // "" if none
  const std::string& eos_token() const { return eos_token_; }  // "" if none
  int32_t bos_id() const { return bos_id_; }                   // -1 if none
  int32_t eos_id() const { return eos_id_; }                   // -1 if none
  bool is_special(int32_t id) const;
  // tokenizer_config.json's clean_up_tokenization_spaces: decode() removes
  // the space before . ? ! , and contractions ('s 'm 've 're n't).
  bool cleans_up_spaces() const { return clean_up_spaces_; }

 private:
  struct Impl;  // the parsed tokenizer.json stages (tokenizer.cpp)
  Tokenizer();
  std::unique_ptr<Impl> impl_;
  std::string bos_token_, eos_token_;
  int32_t bos_id_ = -1, eos_id_ = -1;
  bool clean_up_spaces_ = false;
};

// transformers' clean_up_tokenization on a decoded text.
std::string clean_up_tokenization_spaces(std::string_view text);
// Whether text ends with a proper start of one of its patterns (" ", " '",
// " n'", ...), which more text may still turn into a replacement.
bool clean_up_may_change_tail(std::string_view text);

// Streaming detokenisation: feed one id at a time, get back only complete
// UTF-8 text (never half a character). Keeps a small window of previous ids
// and emits the difference between decode(window + id) and decode(window), so
// that decoders whose output depends on neighbours (a SentencePiece leading
// space that is stripped only at the start) come out as decode() would.
// One StreamDecoder per generated sequence; not thread-safe.
class StreamDecoder {
 public:
  explicit StreamDecoder(const Tokenizer& tok, bool skip_special = true);

  // The new text that id completes; "" while a character is still partial.
  std::string push(int32_t id);
  // What remains (partial characters come out as U+FFFD); resets the state.
  std::string flush();

  // Ids held back at most before their text comes out as it decodes.
  static constexpr size_t kMaxHeld = 16;

 private:
  // Past kMaxHeld held ids: the text up to a cut that no character spans.
  std::string release(const std::string& before, const std::string& after);
  // The ids before `read` are emitted: the last emitted run becomes the context.
  void advance(size_t read);
  const Tokenizer& tok_;
  bool skip_special_;
  std::vector<int32_t> ids_;  // the window: ids_[prefix_ ..] is undecided
  size_t prefix_ = 0;         // start of the ids already emitted as context
  size_t read_ = 0;           // start of the ids not yet emitted
};

}  // namespace moe
