#include "tokenizer/byte_level.h"

#include "tokenizer/utf8.h"

namespace moe::tok {

namespace {
bool shown_as_itself(int b) {
  return (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
}
}  // namespace

ByteAlphabet::ByteAlphabet() {
  byte_of_cp_.fill(-1);
  int next = 256;
  for (int b = 0; b < 256; ++b) {
    const char32_t cp =
        shown_as_itself(b) ? static_cast<char32_t>(b) : static_cast<char32_t>(next++);
    std::string s;
    append_utf8(s, cp);
    lens_[b] = static_cast<uint8_t>(s.size());
    for (size_t k = 0; k < s.size(); ++k) chars_[b][k] = s[k];
    byte_of_cp_[cp] = static_cast<int16_t>(b);
  }
}

void ByteAlphabet::encode(std::string_view raw, std::string& out) const {
  out.reserve(out.size() + raw.size() * 2);
  for (char c : raw) {
    const auto b = static_cast<uint8_t>(c);
    out.append(chars_[b].data(), lens_[b]);
  }
}

bool ByteAlphabet::decode(std::string_view text, std::string& out) const {
  const size_t start = out.size();
  for (size_t i = 0; i < text.size();) {
    const size_t n = utf8_char_len(text, i);
    const char32_t cp = n ? utf8_decode_at(text, i, n) : 0xFFFD;
    if (n == 0 || cp >= byte_of_cp_.size() || byte_of_cp_[cp] < 0) {
      out.resize(start);
      return false;
    }
    out.push_back(static_cast<char>(byte_of_cp_[cp]));
    i += n;
  }
  return true;
}

const ByteAlphabet& byte_alphabet() {
  static const ByteAlphabet alphabet;
  return alphabet;
}

}  // namespace moe::tok
