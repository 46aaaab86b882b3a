#pragma once
// The BPE model of tokenizer.json ("model": {"type": "BPE"}): vocabulary,
// ranked merges, byte fallback, unknown-token handling. Encodes one
// pre-tokenised word at a time, with a cache of words already seen.

#include <array>
#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <shared_mutex>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "model/result.h"

namespace moe::tok {

// Hashing that lets unordered maps keyed by std::string be searched with a
// string_view without building a string.
struct StringHash {
  using is_transparent = void;
  size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
};
using TokenMap = std::unordered_map<std::string, int32_t, StringHash, std::equal_to<>>;

// The largest token id a tokenizer may name (vocabularies in use hold up to
// a few hundred thousand).
inline constexpr int32_t kMaxTokenId = (1 << 24) - 1;

class BpeModel {
 public:
  static Result<std::unique_ptr<BpeModel>> from_json(const nlohmann::json& model);

  // Appends the ids of word (valid UTF-8) to out. Thread-safe.
  void encode_word(std::string_view word, std::vector<int32_t>& out) const;

  int32_t token_to_id(std::string_view token) const;  // -1 if none
  const std::string* id_to_token(int32_t id) const;   // null if none
  int32_t max_id() const { return static_cast<int32_t>(tokens_.size()) - 1; }

 private:
  struct Merge {
    int32_t rank;
    int32_t new_id;
  };
  static uint64_t pair_key(int32_t a, int32_t b) {
    return (static_cast<uint64_t>(static_cast<uint32_t>(a)) << 32) | static_cast<uint32_t>(b);
  }
  void merge_word(std::string_view word, std::vector<int32_t>& out) const;

  TokenMap vocab_;
  std::vector<std::string> tokens_;  // id -> token ("" for holes)
  std::unordered_map<uint64_t, Merge> merges_;
  int32_t unk_id_ = -1;
  bool fuse_unk_ = false;
  bool byte_fallback_ = false;
  bool ignore_merges_ = false;
  std::string subword_prefix_, word_suffix_;
  std::array<int32_t, 256> byte_ids_{};  // id of "<0xNN>", -1 if absent

  // Words already encoded. Bounded; once full, new words are not added.
  mutable std::shared_mutex cache_mu_;
  mutable std::unordered_map<std::string, std::vector<int32_t>, StringHash, std::equal_to<>> cache_;
};

}  // namespace moe::tok
