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

}  // namespace

StreamDecoder::StreamDecoder(const Tokenizer& tok, bool skip_special)
    : tok_(tok), skip_special_(skip_special) {}

std::string StreamDecoder::push(int32_t id) {
  ids_.push_back(id);
  const std::span<const int32_t> all(ids_);
  const std::string before = tok_.decode(all.subspan(prefix_, read_ - prefix_), skip_special_);
  const std::string after = tok_.decode(all.subspan(prefix_), skip_special_);
  // Hold back while the newest bytes are an incomplete character.
  if (after.size() <= before.size() || ends_with_replacement(after)) return {};
  // Clean-up may still change the tail (" ." → ".", " 's" → "'s"): held back
  // while it is the start of one of its patterns.
  if (tok_.cleans_up_spaces() && clean_up_may_change_tail(after)) return {};
  const size_t cut = after.starts_with(before) ? before.size() : common_prefix(before, after);
  std::string out = after.substr(cut);
  prefix_ = read_;
  read_ = ids_.size();
  // Keep only the context window: ids before prefix_ are never read again.
  if (prefix_ > 64) {
    ids_.erase(ids_.begin(), ids_.begin() + static_cast<std::ptrdiff_t>(prefix_));
    read_ -= prefix_;
    prefix_ = 0;
  }
  return out;
}

std::string StreamDecoder::flush() {
  std::string out;
  if (read_ < ids_.size()) {
    const std::span<const int32_t> all(ids_);
    const std::string before = tok_.decode(all.subspan(prefix_, read_ - prefix_), skip_special_);
    const std::string after = tok_.decode(all.subspan(prefix_), skip_special_);
    if (after.size() > before.size()) {
      const size_t cut = after.starts_with(before) ? before.size() : common_prefix(before, after);
      out = after.substr(cut);
    }
  }
  ids_.clear();
  prefix_ = read_ = 0;
  return out;
}

}  // namespace moe
