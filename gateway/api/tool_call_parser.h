#pragma once
// Tool calls out of a model's streamed text, in the Hermes markup Qwen's
// templates ask for: <tool_call>\n{"name": …, "arguments": {…}}\n</tool_call>.
// Text outside the markup passes on as content (a tail that could be the
// start of "<tool_call>" is held until the next piece decides); a call is
// given when its closing tag arrives (or at the end, when the model stopped
// inside one). A block whose JSON is not a call stays content, as written.

#include <string>
#include <string_view>
#include <vector>

namespace moe::gw {

class ToolCallParser {
 public:
  struct Call {
    std::string name;
    std::string arguments;  // JSON text of the arguments object
  };
  struct Step {
    std::string text;  // content to show now
    std::vector<Call> calls;
  };
  Step push(std::string_view piece);
  // The end of the output: what was held, and a call left open.
  Step finish();

 private:
  void take_block(Step* out, bool closed);
  std::string held_;    // outside: a possible start of the open tag; inside: the block so far
  bool inside_ = false;
  bool after_call_ = false;  // the last thing seen was a call: whitespace after it is dropped
};

}  // namespace moe::gw
