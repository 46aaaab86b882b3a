#pragma once
// Normalisers of tokenizer.json ("normalizer"): NFC/NFD/NFKC/NFKD, Lowercase,
// Prepend, Replace (string or regex), Strip, Sequence. They rewrite the text
// of one piece between added tokens; offsets are not tracked (only ids are
// needed).

#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>

#include "model/result.h"

namespace moe::tok {

class Normalizer {
 public:
  virtual ~Normalizer() = default;
  // text is valid UTF-8; the result is too.
  virtual std::string normalize(std::string_view text) const = 0;
};

// A null spec gives a null pointer (no normalisation).
Result<std::unique_ptr<Normalizer>> make_normalizer(const nlohmann::json& spec);

}  // namespace moe::tok
