#pragma once
// Splits a thinking model's output text into its reasoning (between the open
// and close tags, e.g. <think>…</think>) and its answer, as it streams: the
// chat API returns the first as `reasoning_content`, never inside `content`.
// A tag split across pushes is held back until it is whole or ruled out.
//
//  - Output that starts (after whitespace) with the open tag is reasoning up
//    to the close tag; without the open tag it is all answer.
//  - started_inside: the prompt already ended in the open tag (templates
//    that open the reasoning in the generation prompt): reasoning from the
//    first byte.
//  - The whitespace right after the close tag (the "\n\n" models write) is
//    dropped from the answer.
//  - Output that ends inside the reasoning (cut by max_tokens) leaves the
//    answer empty.

#include <string>

namespace moe::gw {

class ReasoningSplitter {
 public:
  struct Parts {
    std::string reasoning, content;
  };

  ReasoningSplitter(std::string open, std::string close, bool started_inside);

  Parts push(const std::string& text);
  // What is held back, at the end of the output.
  Parts finish();
  // The output has reached its answer (after the reasoning, or without any).
  bool in_content() const { return state_ == State::after_close || state_ == State::content; }
  // The output had reasoning (an open tag, or a prompt that opened it).
  bool entered() const { return entered_; }

 private:
  enum class State { start, reasoning, after_close, content };
  Parts drain(bool final);

  std::string open_, close_;
  State state_;
  bool entered_;
  std::string held_;
};

}  // namespace moe::gw
