#include "tokenizer/normalizer.h"

#include <utf8proc.h>

#include <cstdlib>
#include <vector>

#include "tokenizer/regex.h"
#include "tokenizer/replace_pattern.h"
#include "tokenizer/utf8.h"

namespace moe::tok {

namespace {

// Unicode normal forms through utf8proc. ASCII is invariant under all four
// forms and an ASCII character never combines with what precedes it, so
// only the non-ASCII runs (with the one ASCII character before each, which a
// combining mark may attach to) go through utf8proc; the rest is copied.
class UnicodeForm final : public Normalizer {
 public:
  explicit UnicodeForm(int options) : options_(options) {}
  std::string normalize(std::string_view text) const override {
    std::string out;
    out.reserve(text.size());
    size_t copied = 0;  // text[0, copied) is in out
    for (size_t i = 0; i < text.size();) {
      if (static_cast<unsigned char>(text[i]) < 0x80) {
        ++i;
        continue;
      }
      size_t b = i;
      if (b > copied) --b;  // the ASCII starter a mark may compose with
      size_t e = i;
      while (e < text.size() && static_cast<unsigned char>(text[e]) >= 0x80) ++e;
      out.append(text.substr(copied, b - copied));
      map_run(text.substr(b, e - b), out);
      copied = i = e;
    }
    out.append(text.substr(copied));
    return out;
  }

 private:
  void map_run(std::string_view run, std::string& out) const {
    utf8proc_uint8_t* dst = nullptr;
    // An explicit length (not NUL-terminated) so that NUL bytes pass through.
    const utf8proc_ssize_t n =
        utf8proc_map(reinterpret_cast<const utf8proc_uint8_t*>(run.data()),
                     static_cast<utf8proc_ssize_t>(run.size()), &dst,
                     static_cast<utf8proc_option_t>(UTF8PROC_STABLE | options_));
    if (n < 0) {
      out.append(run);
    } else {
      out.append(reinterpret_cast<const char*>(dst), static_cast<size_t>(n));
    }
    std::free(dst);
  }
  int options_;
};

class Lowercase final : public Normalizer {
 public:
  std::string normalize(std::string_view text) const override {
    std::string out;
    out.reserve(text.size());
    for (size_t i = 0; i < text.size();) {
      const size_t n = utf8_char_len(text, i);
      append_utf8(out, static_cast<char32_t>(utf8proc_tolower(
                           static_cast<utf8proc_int32_t>(utf8_decode_at(text, i, n)))));
      i += n;
    }
    return out;
  }
};

// Prepends a string to non-empty text (empty text stays empty).
class Prepend final : public Normalizer {
 public:
  explicit Prepend(std::string prefix) : prefix_(std::move(prefix)) {}
  std::string normalize(std::string_view text) const override {
    if (text.empty()) return {};
    std::string out = prefix_;
    out.append(text);
    return out;
  }

 private:
  std::string prefix_;
};

class Replace final : public Normalizer {
 public:
  explicit Replace(ReplacePattern p) : p_(std::move(p)) {}
  std::string normalize(std::string_view text) const override { return p_.apply(text); }

 private:
  ReplacePattern p_;
};

// Strips Unicode white space from the left and/or right end.
class Strip final : public Normalizer {
 public:
  Strip(bool left, bool right) : left_(left), right_(right) {}
  std::string normalize(std::string_view text) const override {
    size_t b = 0, e = text.size();
    if (left_)
      while (b < e) {
        const size_t n = utf8_char_len(text, b);
        if (!is_space(utf8_decode_at(text, b, n))) break;
        b += n;
      }
    if (right_)
      while (e > b) {
        size_t s = e - 1;
        while (s > b && (static_cast<unsigned char>(text[s]) & 0xC0) == 0x80) --s;
        if (!is_space(utf8_decode_at(text, s, e - s))) break;
        e = s;
      }
    return std::string(text.substr(b, e - b));
  }

 private:
  static bool is_space(char32_t cp) {
    if (cp == ' ' || (cp >= 0x09 && cp <= 0x0D)) return true;
    const auto cat = utf8proc_category(static_cast<utf8proc_int32_t>(cp));
    return cat == UTF8PROC_CATEGORY_ZS || cat == UTF8PROC_CATEGORY_ZL ||
           cat == UTF8PROC_CATEGORY_ZP || cp == 0x85;
  }
  bool left_, right_;
};

class Sequence final : public Normalizer {
 public:
  explicit Sequence(std::vector<std::unique_ptr<Normalizer>> parts) : parts_(std::move(parts)) {}
  std::string normalize(std::string_view text) const override {
    std::string cur(text);
    for (const auto& p : parts_) cur = p->normalize(cur);
    return cur;
  }

 private:
  std::vector<std::unique_ptr<Normalizer>> parts_;
};

}  // namespace

Result<std::unique_ptr<Normalizer>> make_normalizer(const nlohmann::json& spec) {
  if (spec.is_null()) return std::unique_ptr<Normalizer>();
  if (!spec.is_object() || !spec.contains("type"))
    return make_error("normalizer: not an object with a type");
  const std::string type = spec["type"].get<std::string>();
  if (type == "NFC") return std::unique_ptr<Normalizer>(new UnicodeForm(UTF8PROC_COMPOSE));
  if (type == "NFD") return std::unique_ptr<Normalizer>(new UnicodeForm(UTF8PROC_DECOMPOSE));
  if (type == "NFKC")
    return std::unique_ptr<Normalizer>(new UnicodeForm(UTF8PROC_COMPOSE | UTF8PROC_COMPAT));
  if (type == "NFKD")
    return std::unique_ptr<Normalizer>(new UnicodeForm(UTF8PROC_DECOMPOSE | UTF8PROC_COMPAT));
  if (type == "Lowercase") return std::unique_ptr<Normalizer>(new Lowercase());
  if (type == "Prepend") return std::unique_ptr<Normalizer>(new Prepend(spec.value("prepend", "")));
  if (type == "Strip")
    return std::unique_ptr<Normalizer>(
        new Strip(spec.value("strip_left", true), spec.value("strip_right", true)));
  if (type == "Replace") {
    auto p = ReplacePattern::from_json(spec);
    if (!p) return make_error("normalizer Replace: " + p.error());
    return std::unique_ptr<Normalizer>(new Replace(std::move(p.value())));
  }
  if (type == "Sequence") {
    std::vector<std::unique_ptr<Normalizer>> parts;
    for (const auto& sub : spec.value("normalizers", nlohmann::json::array())) {
      auto n = make_normalizer(sub);
      if (!n) return make_error(n.error());
      if (n.value()) parts.push_back(std::move(n.value()));
    }
    return std::unique_ptr<Normalizer>(new Sequence(std::move(parts)));
  }
  return make_error("normalizer type '" + type + "' is not supported");
}

}  // namespace moe::tok
