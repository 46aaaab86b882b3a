#include "tokenizer/pretokenizer.h"

#include <algorithm>
#include <utility>

#include "tokenizer/byte_level.h"
#include "tokenizer/regex.h"

namespace moe::tok {

namespace {

// The GPT-2 pre-tokenisation pattern used by ByteLevel with use_regex.
constexpr const char* kGpt2Pattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

struct Span {
  size_t b, e;
  bool match;
};

class Split final : public PreTokenizer {
 public:
  Split(std::shared_ptr<const Regex> re, std::string literal, SplitBehavior behavior, bool invert)
      : re_(std::move(re)), literal_(std::move(literal)), behavior_(behavior), invert_(invert) {}

  void pre_tokenize(std::vector<std::string>& pieces, bool) const override {
    std::vector<std::string> out;
    out.reserve(pieces.size() * 4);
    std::vector<std::pair<size_t, size_t>> matches;
    for (const auto& p : pieces) {
      matches.clear();
      if (re_) {
        re_->find_all(p, matches);
      } else if (!literal_.empty()) {
        for (size_t pos = 0, hit; (hit = p.find(literal_, pos)) != std::string::npos;
             pos = hit + literal_.size())
          matches.emplace_back(hit, hit + literal_.size());
      }
      split_by_matches(p, matches, behavior_, invert_, out);
    }
    pieces = std::move(out);
  }

 private:
  std::shared_ptr<const Regex> re_;
  std::string literal_;
  SplitBehavior behavior_;
  bool invert_;
};

class ByteLevel final : public PreTokenizer {
 public:
  ByteLevel(bool add_prefix_space, std::shared_ptr<const Regex> re)
      : add_prefix_space_(add_prefix_space), re_(std::move(re)) {}

  void pre_tokenize(std::vector<std::string>& pieces, bool) const override {
    std::vector<std::string> split;
    std::vector<std::pair<size_t, size_t>> matches;
    for (auto& p : pieces) {
      if (add_prefix_space_ && (p.empty() || p[0] != ' ')) p.insert(p.begin(), ' ');
      if (re_) {
        matches.clear();
        re_->find_all(p, matches);
        split_by_matches(p, matches, SplitBehavior::kIsolated, false, split);
      } else if (!p.empty()) {
        split.push_back(std::move(p));
      }
    }
    const ByteAlphabet& alphabet = byte_alphabet();
    pieces.clear();
    pieces.reserve(split.size());
    for (const auto& s : split) {
      std::string mapped;
      alphabet.encode(s, mapped);
      pieces.push_back(std::move(mapped));
    }
  }

 private:
  bool add_prefix_space_;
  std::shared_ptr<const Regex> re_;  // null when use_regex is false
};

// SentencePiece-style: spaces become the replacement character, which is
// prepended to the text (per prepend_scheme) and starts every word.
class Metaspace final : public PreTokenizer {
 public:
  enum class Prepend { kAlways, kFirst, kNever };
  Metaspace(std::string replacement, Prepend prepend, bool split)
      : repl_(std::move(replacement)), prepend_(prepend), split_(split) {}

  void pre_tokenize(std::vector<std::string>& pieces, bool at_text_start) const override {
    std::vector<std::string> out;
    std::vector<std::pair<size_t, size_t>> matches;
    for (size_t i = 0; i < pieces.size(); ++i) {
      std::string s;
      for (char c : pieces[i]) {
        if (c == ' ')
          s += repl_;
        else
          s.push_back(c);
      }
      const bool prepend =
          prepend_ == Prepend::kAlways || (prepend_ == Prepend::kFirst && i == 0 && at_text_start);
      if (prepend && !s.empty() && s.compare(0, repl_.size(), repl_) != 0) s.insert(0, repl_);
      if (!split_) {
        if (!s.empty()) out.push_back(std::move(s));
        continue;
      }
      matches.clear();
      for (size_t pos = 0, hit; (hit = s.find(repl_, pos)) != std::string::npos;
           pos = hit + repl_.size())
        matches.emplace_back(hit, hit + repl_.size());
      split_by_matches(s, matches, SplitBehavior::kMergedWithNext, false, out);
    }
    pieces = std::move(out);
  }

 private:
  std::string repl_;
  Prepend prepend_;
  bool split_;
};

class Sequence final : public PreTokenizer {
 public:
  explicit Sequence(std::vector<std::unique_ptr<PreTokenizer>> parts) : parts_(std::move(parts)) {}
  void pre_tokenize(std::vector<std::string>& pieces, bool at_text_start) const override {
    for (const auto& p : parts_) p->pre_tokenize(pieces, at_text_start);
  }

 private:
  std::vector<std::unique_ptr<PreTokenizer>> parts_;
};

Result<SplitBehavior> parse_behavior(const std::string& s) {
  if (s == "Removed") return SplitBehavior::kRemoved;
  if (s == "Isolated") return SplitBehavior::kIsolated;
  if (s == "MergedWithPrevious") return SplitBehavior::kMergedWithPrevious;
  if (s == "MergedWithNext") return SplitBehavior::kMergedWithNext;
  if (s == "Contiguous") return SplitBehavior::kContiguous;
  return make_error("unknown split behavior '" + s + "'");
}

}  // namespace

void split_by_matches(const std::string& text,
                      const std::vector<std::pair<size_t, size_t>>& matches, SplitBehavior behavior,
                      bool invert, std::vector<std::string>& out) {
  if (text.empty()) return;
  // Alternate gaps and matches covering the whole text.
  std::vector<Span> spans;
  spans.reserve(matches.size() * 2 + 1);
  size_t prev = 0;
  for (const auto& [b, e] : matches) {
    if (b > prev) spans.push_back({prev, b, invert});
    spans.push_back({b, e, !invert});
    prev = e;
  }
  if (prev < text.size()) spans.push_back({prev, text.size(), invert});

  // Merge spans into pieces by the behaviour; `keep` marks removed ones.
  std::vector<Span> pieces;  // match flag here means "remove"
  pieces.reserve(spans.size());
  switch (behavior) {
    case SplitBehavior::kRemoved:
      for (const auto& s : spans) pieces.push_back({s.b, s.e, s.match});
      break;
    case SplitBehavior::kIsolated:
      for (const auto& s : spans) pieces.push_back({s.b, s.e, false});
      break;
    case SplitBehavior::kMergedWithPrevious: {
      bool prev_match = false;
      for (const auto& s : spans) {
        if (s.match && !prev_match && !pieces.empty())
          pieces.back().e = s.e;
        else
          pieces.push_back({s.b, s.e, false});
        prev_match = s.match;
      }
      break;
    }
    case SplitBehavior::kMergedWithNext: {
      bool prev_match = false;
      for (size_t k = spans.size(); k-- > 0;) {
        const auto& s = spans[k];
        if (s.match && !prev_match && !pieces.empty())
          pieces.back().b = s.b;
        else
          pieces.push_back({s.b, s.e, false});
        prev_match = s.match;
      }
      std::reverse(pieces.begin(), pieces.end());
      break;
    }
    case SplitBehavior::kContiguous: {
      bool prev_match = false;
      for (const auto& s : spans) {
        if (s.match == prev_match && !pieces.empty())
          pieces.back().e = s.e;
        else
          pieces.push_back({s.b, s.e, false});
        prev_match = s.match;
      }
      break;
    }
  }
  for (const auto& p : pieces)
    if (!p.match && p.e > p.b) out.emplace_back(text, p.b, p.e - p.b);
}

Result<std::unique_ptr<PreTokenizer>> make_pre_tokenizer(const nlohmann::json& spec) {
  if (spec.is_null()) return std::unique_ptr<PreTokenizer>();
  if (!spec.is_object() || !spec.contains("type"))
    return make_error("pre_tokenizer: not an object with a type");
  const std::string type = spec["type"].get<std::string>();
  if (type == "Split") {
    auto behavior = parse_behavior(spec.value("behavior", "Isolated"));
    if (!behavior) return make_error("pre_tokenizer Split: " + behavior.error());
    const auto& pat = spec.value("pattern", nlohmann::json::object());
    std::shared_ptr<const Regex> re;
    std::string literal;
    if (pat.contains("Regex")) {
      auto r = Regex::compile(pat["Regex"].get<std::string>());
      if (!r) return make_error("pre_tokenizer Split: " + r.error());
      re = std::move(r.value());
    } else if (pat.contains("String")) {
      literal = pat["String"].get<std::string>();
    } else {
      return make_error("pre_tokenizer Split: pattern is neither Regex nor String");
    }
    return std::unique_ptr<PreTokenizer>(
        new Split(std::move(re), std::move(literal), *behavior, spec.value("invert", false)));
  }
  if (type == "ByteLevel") {
    std::shared_ptr<const Regex> re;
    if (spec.value("use_regex", true)) {
      auto r = Regex::compile(kGpt2Pattern);
      if (!r) return make_error("pre_tokenizer ByteLevel: " + r.error());
      re = std::move(r.value());
    }
    return std::unique_ptr<PreTokenizer>(
        new ByteLevel(spec.value("add_prefix_space", false), std::move(re)));
  }
  if (type == "Metaspace") {
    Metaspace::Prepend prepend = Metaspace::Prepend::kAlways;
    if (spec.contains("prepend_scheme")) {
      const std::string s = spec["prepend_scheme"].get<std::string>();
      prepend = s == "first"   ? Metaspace::Prepend::kFirst
                : s == "never" ? Metaspace::Prepend::kNever
                               : Metaspace::Prepend::kAlways;
    } else if (spec.contains("add_prefix_space") && !spec.value("add_prefix_space", true)) {
      prepend = Metaspace::Prepend::kNever;
    }
    return std::unique_ptr<PreTokenizer>(new Metaspace(spec.value("replacement", "\xE2\x96\x81"),
                                                       prepend, spec.value("split", true)));
  }
  if (type == "Sequence") {
    std::vector<std::unique_ptr<PreTokenizer>> parts;
    for (const auto& sub : spec.value("pretokenizers", nlohmann::json::array())) {
      auto p = make_pre_tokenizer(sub);
      if (!p) return make_error(p.error());
      if (p.value()) parts.push_back(std::move(p.value()));
    }
    return std::unique_ptr<PreTokenizer>(new Sequence(std::move(parts)));
  }
  return make_error("pre_tokenizer type '" + type + "' is not supported");
}

}  // namespace moe::tok
