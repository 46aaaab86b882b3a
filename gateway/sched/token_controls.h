#pragma once
// The token adjustments the gateway sends with each sampled chunk
// (docs/sampling.md): the request's logit_bias, the prompt's and the
// output's tokens when a penalty asks for them, and a ban of the stop ids
// while fewer than min_tokens tokens were generated. The worker keeps none
// of this, so a sequence resumed on another worker (or after preemption)
// samples exactly as before: the list is rebuilt from prompt + generated.

#include <cstdint>
#include <span>
#include <vector>

#include "gateway/sched/scheduler.h"

namespace moe::gw {

class TokenControls {
 public:
  TokenControls() = default;
  // A sequence of `req` that has already generated `generated`.
  TokenControls(const SequenceRequest& req, std::span<const int32_t> generated);

  // One more generated token.
  void generated(int32_t token);
  // The list for the next sampled row (sorted by token, distinct), after
  // `generated_count` generated tokens.
  std::vector<TokenAdjust> next(const SequenceRequest& req, int generated_count) const;
  // Structured output: the tokens the grammar allows next (the stop ids
  // where the value may end); empty without a grammar.
  std::vector<uint32_t> allowed(const SequenceRequest& req) const;
  // The grammar's value is whole and nothing can follow: the choice is over.
  bool closed() const { return grammar_ && state_.closed(); }
  // A token the grammar refused (a worker that ignored the mask).
  bool broken() const { return grammar_ && state_.empty(); }

 private:
  bool track_ = false;              // a penalty is on: prompt and output tokens are listed
  std::vector<TokenAdjust> list_;   // sorted: biases, and the tracked tokens
  TokenAdjust& at(int32_t token);   // the entry of `token`, inserted when absent
  std::shared_ptr<const structured::TokenGrammar> grammar_;
  structured::GrammarState state_;
};

// True when a request's sampling asks for the prompt's and output's tokens.
bool penalties_on(const Sampling& s);

}  // namespace moe::gw
