#include "tokenizer/utf8.h"

namespace moe::tok {

namespace {

bool is_cont(unsigned char c) { return (c & 0xC0) == 0x80; }

// Allowed range of the second byte for a lead byte (Unicode table 3-7);
// returns the sequence length or 0 for a byte that cannot lead.
size_t lead_info(unsigned char b, unsigned char& lo, unsigned char& hi) {
  lo = 0x80;
  hi = 0xBF;
  if (b < 0x80) return 1;
  if (b >= 0xC2 && b <= 0xDF) return 2;
  if (b == 0xE0) {
    lo = 0xA0;
    return 3;
  }
  if (b == 0xED) {
    hi = 0x9F;
    return 3;
  }
  if (b >= 0xE1 && b <= 0xEF) return 3;
  if (b == 0xF0) {
    lo = 0x90;
    return 4;
  }
  if (b == 0xF4) {
    hi = 0x8F;
    return 4;
  }
  if (b >= 0xF1 && b <= 0xF3) return 4;
  return 0;
}

// Number of leading bytes of the sequence at s[i] that are well-formed so far.
size_t valid_run(std::string_view s, size_t i, size_t& need) {
  unsigned char lo, hi;
  const auto b = static_cast<unsigned char>(s[i]);
  need = lead_info(b, lo, hi);
  if (need == 0) return 0;
  if (need == 1) return 1;
  size_t k = 1;
  if (i + k >= s.size()) return k;
  const auto b1 = static_cast<unsigned char>(s[i + k]);
  if (b1 < lo || b1 > hi) return k;
  for (++k; k < need; ++k)
    if (i + k >= s.size() || !is_cont(static_cast<unsigned char>(s[i + k]))) return k;
  return k;
}

}  // namespace

size_t utf8_char_len(std::string_view s, size_t i) {
  const auto b = static_cast<unsigned char>(s[i]);
  if (b < 0x80) return 1;
  size_t need;
  const size_t run = valid_run(s, i, need);
  return run == need ? need : 0;
}

size_t utf8_invalid_len(std::string_view s, size_t i) {
  size_t need;
  const size_t run = valid_run(s, i, need);
  return run == 0 ? 1 : run;
}

bool utf8_valid(std::string_view s) {
  for (size_t i = 0; i < s.size();) {
    if (static_cast<unsigned char>(s[i]) < 0x80) {
      ++i;
      continue;
    }
    const size_t n = utf8_char_len(s, i);
    if (n == 0) return false;
    i += n;
  }
  return true;
}

std::string sanitize_utf8(std::string_view s) {
  if (utf8_valid(s)) return std::string(s);
  std::string out;
  out.reserve(s.size() + 8);
  for (size_t i = 0; i < s.size();) {
    const size_t n = utf8_char_len(s, i);
    if (n) {
      out.append(s.substr(i, n));
      i += n;
    } else {
      out.append(kReplacementChar);
      i += utf8_invalid_len(s, i);
    }
  }
  return out;
}

char32_t utf8_decode_at(std::string_view s, size_t i, size_t len) {
  const auto b = [&](size_t k) {
    return static_cast<char32_t>(static_cast<unsigned char>(s[i + k]));
  };
  switch (len) {
    case 1:
      return b(0);
    case 2:
      return ((b(0) & 0x1F) << 6) | (b(1) & 0x3F);
    case 3:
      return ((b(0) & 0x0F) << 12) | ((b(1) & 0x3F) << 6) | (b(2) & 0x3F);
    default:
      return ((b(0) & 0x07) << 18) | ((b(1) & 0x3F) << 12) | ((b(2) & 0x3F) << 6) | (b(3) & 0x3F);
  }
}

void append_utf8(std::string& out, char32_t cp) {
  if (cp < 0x80) {
    out.push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out.push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out.push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    out.push_back(static_cast<char>(0xF0 | (cp >> 18)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

}  // namespace moe::tok
