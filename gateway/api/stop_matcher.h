#pragma once
// Stop strings over streamed text. Text is released only when no stop
// string can still match through it: a tail that is the start of a stop
// string is held back until the next piece decides. On a match, the text
// before it is released and nothing of the stop string itself.

#include <string>
#include <string_view>
#include <vector>

namespace moe::gw {

class StopMatcher {
 public:
  explicit StopMatcher(std::vector<std::string> stops);

  struct Step {
    std::string text;      // safe to show now
    bool stopped = false;  // a stop string matched; push() does nothing more
  };
  // Adds generated text; returns what may be shown.
  Step push(std::string_view piece);
  // The end of generation: the held tail could not start a match after all.
  std::string finish();
  bool stopped() const { return stopped_; }

 private:
  std::vector<std::string> stops_;  // non-empty strings only
  std::string held_;                // text not yet released
  bool stopped_ = false;
};

}  // namespace moe::gw
