#include "tokenizer/tokenizer.h"
#include "tokenizer/utf8.h"

namespace moe {

namespace {

bool ends_with_replacement(const std::string& s) { return s.ends_with(tok::kReplacementChar); }

// Length of the longest common prefix of a and b, backed off to a character
// boundary of b so that b.substr(result) is valid UTF-8.
size_t common_prefix(const std::string& a, const std::string& b) {
  size_t n = 0;
  while (n < a.size() && n < b.size() && a[n] == b[n]) ++n;
  while (n > 0 && n < b.size() && (static_cast<unsigned char>(b[n]) & 0xC0) == 0x80) --n;
  return n;
}

// The text `text` adds past `before` (which it starts with, or with what
// clean-up left of it).
std::string new_text(const std::string& before, const std::string& text) {
  const size_t cut = text.starts_with(before) ? before.size() : common_prefix(before, text);
  return text.size() > cut ? text.substr(cut) : std::string();
}

}  // namespace

StreamDecoder::StreamDecoder(const Tokenizer& tok, bool skip_special)
    : tok_(tok), skip_special_(skip_special) {}

std::string StreamDecoder::push(int32_t id) {
  ids_.push_back(id);
  const std::span<const int32_t> all(ids_);
  const std::string before = tok_.decode(all.subspan(prefix_, read_ - prefix_), skip_special_);
  const std::string after = tok_.decode(all.subspan(prefix_), skip_special_);
  // Hold back while the newest bytes are an incomplete character (or add no
  // text: skipped special tokens), but not past kMaxHeld ids: a window that
  // only grew would make every push decode it all again (100,000 lone lead
  // bytes took /detokenize 69 s). Past that, release() lets out the text up
  // to a cut no character spans (U+FFFD for bytes that never became one).
  if (ids_.size() - read_ > kMaxHeld) return release(before, after);
  if (after.size() <= before.size() || ends_with_replacement(after)) return {};
  // Clean-up may still change the tail (" ." → ".", " 's" → "'s"): held
  // back while it is the start of one of its patterns.
  if (tok_.cleans_up_spaces() && clean_up_may_change_tail(after)) return {};
  std::string out = new_text(before, after);
  advance(ids_.size());
  return out;
}

std::string StreamDecoder::release(const std::string& before, const std::string& after) {
  // The text of all but the newest kKeep ids, where it is what the whole
  // window decodes to so far (no character spans the cut: a character is at
  // most 4 bytes, so one that could still complete lies in the ids kept).
  constexpr size_t kKeep = 4;
  const std::span<const int32_t> all(ids_);
  for (size_t c = ids_.size() - kKeep; c > read_; --c) {
    const std::string part = tok_.decode(all.subspan(prefix_, c - prefix_), skip_special_);
    if (!after.starts_with(part)) continue;
    std::string out = new_text(before, part);
    advance(c);
    return out;
  }
  return {};  // no such cut: held as before
}

void StreamDecoder::advance(size_t read) {
  prefix_ = read_;
  read_ = read;
  // Keep only the context window: ids before prefix_ are never read again.
  if (prefix_ > 64) {
    ids_.erase(ids_.begin(), ids_.begin() + static_cast<std::ptrdiff_t>(prefix_));
    read_ -= prefix_;
    prefix_ = 0;
  }
}

std::string StreamDecoder::flush() {
  std::string out;
  if (read_ < ids_.size()) {
    const std::span<const int32_t> all(ids_);
    const std::string before = tok_.decode(all.subspan(prefix_, read_ - prefix_), skip_special_);
    const std::string after = tok_.decode(all.subspan(prefix_), skip_special_);
    if (after.size() > before.size()) out = new_text(before, after);
  }
  ids_.clear();
  prefix_ = read_ = 0;
  return out;
}

}  // namespace moe
