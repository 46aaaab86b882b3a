#include "tokenizer/added_vocabulary.h"

#include <utf8proc.h>

#include <algorithm>

#include "tokenizer/utf8.h"

namespace moe::tok {

namespace {

bool is_word_char(char32_t cp) {
  if (cp == '_') return true;
  if (cp < 0x80) return (cp >= '0' && cp <= '9') || ((cp | 0x20) >= 'a' && (cp | 0x20) <= 'z');
  const auto cat = utf8proc_category(static_cast<utf8proc_int32_t>(cp));
  return (cat >= UTF8PROC_CATEGORY_LU && cat <= UTF8PROC_CATEGORY_LO) ||
         (cat >= UTF8PROC_CATEGORY_ND && cat <= UTF8PROC_CATEGORY_NO);
}

// The character ending just before position e (e > 0).
char32_t char_before(std::string_view s, size_t e) {
  size_t b = e - 1;
  while (b > 0 && (static_cast<unsigned char>(s[b]) & 0xC0) == 0x80) --b;
  const size_t n = utf8_char_len(s, b);
  return n ? utf8_decode_at(s, b, n) : 0xFFFD;
}

char32_t char_at(std::string_view s, size_t b) {
  const size_t n = utf8_char_len(s, b);
  return n ? utf8_decode_at(s, b, n) : 0xFFFD;
}

bool is_space_char(char32_t cp) {
  if (cp == ' ' || (cp >= 0x09 && cp <= 0x0D) || cp == 0x85) return true;
  const auto cat = utf8proc_category(static_cast<utf8proc_int32_t>(cp));
  return cat == UTF8PROC_CATEGORY_ZS || cat == UTF8PROC_CATEGORY_ZL || cat == UTF8PROC_CATEGORY_ZP;
}

size_t char_start_before(std::string_view s, size_t e) {
  size_t b = e - 1;
  while (b > 0 && (static_cast<unsigned char>(s[b]) & 0xC0) == 0x80) --b;
  return b;
}

}  // namespace

AddedMatcher::AddedMatcher(std::vector<AddedToken> tokens)
    : tokens_(std::move(tokens)), by_first_byte_(256) {
  std::erase_if(tokens_, [](const AddedToken& t) { return t.content.empty(); });
  for (uint32_t i = 0; i < tokens_.size(); ++i)
    by_first_byte_[static_cast<uint8_t>(tokens_[i].content[0])].push_back(i);
  for (auto& v : by_first_byte_)
    std::stable_sort(v.begin(), v.end(), [&](uint32_t a, uint32_t b) {
      return tokens_[a].content.size() > tokens_[b].content.size();
    });
}

void AddedMatcher::split(std::string_view text, std::vector<Segment>& out) const {
  const size_t first_out = out.size();
  size_t plain_from = 0;  // start of the plain text not yet emitted
  size_t pos = 0;
  while (pos < text.size()) {
    const auto& cands = by_first_byte_[static_cast<uint8_t>(text[pos])];
    const AddedToken* hit = nullptr;
    for (uint32_t i : cands) {
      const auto& t = tokens_[i];
      if (text.compare(pos, t.content.size(), t.content) == 0) {
        hit = &t;
        break;
      }
    }
    if (!hit) {
      ++pos;
      continue;
    }
    size_t b = pos, e = pos + hit->content.size();
    if (hit->single_word) {
      const bool left_ok = b == 0 || !is_word_char(char_before(text, b));
      const bool right_ok = e == text.size() || !is_word_char(char_at(text, e));
      if (!left_ok || !right_ok) {
        pos = e;  // the rejected match is consumed, as a leftmost-longest scan would
        continue;
      }
    }
    if (hit->lstrip)
      while (b > plain_from && is_space_char(char_before(text, b))) b = char_start_before(text, b);
    if (hit->rstrip)
      while (e < text.size() && is_space_char(char_at(text, e)))
        e += std::max<size_t>(1, utf8_char_len(text, e));
    if (b > plain_from) out.push_back({text.substr(plain_from, b - plain_from), -1});
    out.push_back({text.substr(b, e - b), hit->id});
    plain_from = pos = e;
  }
  if (plain_from < text.size() || out.size() == first_out)
    out.push_back({text.substr(plain_from), -1});
}

}  // namespace moe::tok
