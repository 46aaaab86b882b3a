#pragma once
// The byte-level alphabet: every byte 0..255 is shown as one printable
// Unicode character (printable Latin-1 bytes as themselves, the others as
// U+0100 onwards, in byte order), so that BPE over "characters" is BPE over
// bytes and no text is ever out of vocabulary.

#include <array>
#include <cstdint>
#include <string>
#include <string_view>

namespace moe::tok {

class ByteAlphabet {
 public:
  ByteAlphabet();

  // The UTF-8 text of the character that stands for byte b.
  std::string_view char_of(uint8_t b) const { return {chars_[b].data(), lens_[b]}; }
  // Appends the alphabet form of every byte of raw.
  void encode(std::string_view raw, std::string& out) const;
  // Maps each character of text back to its byte; false (out unchanged) when
  // some character is not in the alphabet.
  bool decode(std::string_view text, std::string& out) const;

 private:
  std::array<std::array<char, 2>, 256> chars_{};  // UTF-8 of each byte's char
  std::array<uint8_t, 256> lens_{};
  std::array<int16_t, 512> byte_of_cp_{};  // code point -> byte, -1 if none
};

// The alphabet is a constant; one shared immutable instance.
const ByteAlphabet& byte_alphabet();

}  // namespace moe::tok
