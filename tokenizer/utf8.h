#pragma once
// UTF-8 helpers shared by the tokenizer's stages: validation, lossy repair,
// and code-point access. Text inside the tokenizer is always valid UTF-8
// once it has passed through sanitize_utf8().

#include <cstddef>
#include <string>
#include <string_view>

namespace moe::tok {

// Length in bytes of the well-formed UTF-8 character starting at s[i], or 0
// when the bytes there do not form one (bad lead, bad or missing continuation).
size_t utf8_char_len(std::string_view s, size_t i);

// Length of the maximal prefix of a (possibly truncated) sequence starting at
// s[i] that could still begin a valid character; at least 1. This is how far
// a lossy decoder skips when it writes one U+FFFD.
size_t utf8_invalid_len(std::string_view s, size_t i);

bool utf8_valid(std::string_view s);

// Replaces each maximal invalid subsequence by one U+FFFD, as a lossy UTF-8
// decoder does; valid input comes back unchanged.
std::string sanitize_utf8(std::string_view s);

// Decodes the well-formed character at s[i] (caller checked utf8_char_len).
char32_t utf8_decode_at(std::string_view s, size_t i, size_t len);

void append_utf8(std::string& out, char32_t cp);

inline constexpr std::string_view kReplacementChar = "\xEF\xBF\xBD";  // U+FFFD

}  // namespace moe::tok
