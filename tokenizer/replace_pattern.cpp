#include "tokenizer/replace_pattern.h"

#include <utility>
#include <vector>

namespace moe::tok {

Result<ReplacePattern> ReplacePattern::from_json(const nlohmann::json& spec) {
  ReplacePattern p;
  if (!spec.contains("pattern") || !spec["pattern"].is_object())
    return make_error("missing pattern");
  const auto& pat = spec["pattern"];
  if (pat.contains("String")) {
    p.literal_ = pat["String"].get<std::string>();
    if (p.literal_.empty()) return make_error("empty pattern");
  } else if (pat.contains("Regex")) {
    auto re = Regex::compile(pat["Regex"].get<std::string>());
    if (!re) return make_error(re.error());
    p.regex_ = std::move(re.value());
  } else {
    return make_error("pattern is neither String nor Regex");
  }
  p.content_ = spec.value("content", "");
  return p;
}

std::string ReplacePattern::apply(std::string_view text) const {
  std::string out;
  out.reserve(text.size());
  if (!regex_) {
    size_t pos = 0;
    for (size_t hit; (hit = text.find(literal_, pos)) != std::string_view::npos;
         pos = hit + literal_.size()) {
      out.append(text.substr(pos, hit - pos));
      out.append(content_);
    }
    out.append(text.substr(pos));
    return out;
  }
  std::vector<std::pair<size_t, size_t>> hits;
  regex_->find_all(text, hits);
  size_t pos = 0;
  for (const auto& [b, e] : hits) {
    out.append(text.substr(pos, b - pos));
    out.append(content_);
    pos = e;
  }
  out.append(text.substr(pos));
  return out;
}

}  // namespace moe::tok
