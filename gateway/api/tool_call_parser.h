#pragma once
// Tool calls out of a model's streamed text, in the markup its template asks
// for. Hermes (Qwen's): <tool_call>\n{"name": …, "arguments": {…}}\n</tool_call>,
// a call given when its closing tag arrives (or at the end, when the model
// stopped inside one). Mistral's: [TOOL_CALLS] [{"name", "arguments"}, …] to
// the end of the output, the calls given at the end. Text outside the
// markup passes on as content (a tail that could start the markup is held
// until the next piece decides); markup whose JSON is not calls stays
// content, as written.

#include <string>
#include <string_view>
#include <vector>

namespace moe::gw {

class ToolCallParser {
 public:
  enum class Markup { hermes, mistral };
  explicit ToolCallParser(Markup markup = Markup::hermes) : markup_(markup) {}
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
  Markup markup_;
  void take_list(Step* out);  // Mistral: the buffered list after the marker
};

}  // namespace moe::gw
