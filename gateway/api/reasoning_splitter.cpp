#include "gateway/api/reasoning_splitter.h"
#include <algorithm>

namespace moe::gw {
namespace {

bool is_space(char c) { return c == ' ' || c == '\n' || c == '\r' || c == '\t'; }

// The length of the longest suffix of `s` that is a proper prefix of `tag`.
size_t partial_tag_suffix(const std::string& s, const std::string& tag) {
  for (size_t n = std::min(s.size(), tag.size() - 1); n > 0; --n)
    if (s.compare(s.size() - n, n, tag, 0, n) == 0) return n;
  return 0;
}

}  // namespace

ReasoningSplitter::ReasoningSplitter(std::string open, std::string close, bool started_inside)
    : open_(std::move(open)),
      close_(std::move(close)),
      state_(started_inside ? State::reasoning : State::start),
      entered_(started_inside) {}

ReasoningSplitter::Parts ReasoningSplitter::push(const std::string& text) {
  held_ += text;
  return drain(false);
}

ReasoningSplitter::Parts ReasoningSplitter::finish() { return drain(true); }

ReasoningSplitter::Parts ReasoningSplitter::drain(bool final) {
  Parts out;
  for (;;) {
    switch (state_) {
      case State::start: {
        size_t i = 0;
        while (i < held_.size() && is_space(held_[i])) ++i;
        const std::string rest = held_.substr(i);
        if (rest.size() >= open_.size()) {
          if (rest.compare(0, open_.size(), open_) == 0) {
            held_ = rest.substr(open_.size());
            state_ = State::reasoning;
            entered_ = true;
          } else {
            state_ = State::content;
          }
          continue;
        }
        if (!final && open_.compare(0, rest.size(), rest) == 0) return out;  // still maybe the tag
        state_ = State::content;
        continue;
      }
      case State::reasoning: {
        const size_t at = held_.find(close_);
        if (at != std::string::npos) {
          out.reasoning += held_.substr(0, at);
          held_ = held_.substr(at + close_.size());
          state_ = State::after_close;
          continue;
        }
        const size_t keep = final ? 0 : partial_tag_suffix(held_, close_);
        out.reasoning += held_.substr(0, held_.size() - keep);
        held_ = held_.substr(held_.size() - keep);
        return out;
      }
      case State::after_close: {
        size_t i = 0;
        while (i < held_.size() && is_space(held_[i])) ++i;
        held_ = held_.substr(i);
        if (held_.empty() && !final) return out;
        state_ = State::content;
        continue;
      }
      case State::content:
        out.content += held_;
        held_.clear();
        return out;
    }
  }
}

}  // namespace moe::gw
