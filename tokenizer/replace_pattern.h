#pragma once
// The {"pattern": {"String"|"Regex": ...}, "content": ...} rule shared by the
// Replace normaliser and the Replace decoder: every match becomes content.

#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>

#include "model/result.h"
#include "tokenizer/regex.h"

namespace moe::tok {

class ReplacePattern {
 public:
  static Result<ReplacePattern> from_json(const nlohmann::json& spec);
  std::string apply(std::string_view text) const;

 private:
  std::string literal_;  // used when regex_ is null
  std::shared_ptr<const Regex> regex_;
  std::string content_;
};

}  // namespace moe::tok
