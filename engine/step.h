#pragma once
// The step contract every engine keeps (engine/engine.h; CpuEngine,
// CudaEngine): what a step asks of each sequence and what comes back.

#include <cstdint>
#include <utility>
#include <vector>

#include "kernels/logit_adjust.h"
#include "kernels/sample_draw.h"

namespace moe {

// The draw (temperature, top_p, top_k, seed) as the kernels take it, and
// what to report of the row.
struct SamplingParams : SampleDraw {
  int top_logprobs = 0;   // how many alternatives to report in SeqOutput::top
  bool logprobs = false;  // report the sampled token's log probability
  // Applied to the row before the draw (docs/sampling.md): the penalties
  // over the listed tokens, and their biases. Sorted by token, distinct.
  Penalties penalties;
  std::vector<TokenAdjust> adjust;
  // Bit t % 32 of word t / 32: token t may be drawn; empty: all. Else
  // ceil(vocab / 32) words (docs/structured-output.md).
  std::vector<uint32_t> allowed;
};

struct SeqInput {
  uint64_t seq_id = 0;
  std::vector<int32_t> tokens;  // the new tokens of this step (prompt chunk or last sampled token)
  int32_t start_pos = 0;  // position of tokens[0] = the sequence's current length; 0 starts afresh
  bool sample = true;     // sample a next token after the last one
  SamplingParams sampling;
  // With `sample`: the token whose raw log probability at the next position
  // goes to SeqOutput::score_logprob (teacher-forced scoring: perplexity,
  // the cost of a quantisation); -1: none.
  int32_t score_token = -1;
};

struct SeqOutput {
  uint64_t seq_id = 0;
  int32_t token = -1;  // the sampled token, -1 when not sampling
  float logprob = 0;   // raw-model log probability of `token` (before temperature)
  std::vector<std::pair<int32_t, float>> top;  // [top_logprobs] best tokens, raw log probabilities
  float score_logprob = 0;  // raw log probability of SeqInput::score_token (when given)
  int32_t cached_tokens = 0;  // of a fresh prompt, the tokens whose KV came from the prefix cache
  std::vector<uint16_t>
      expert_counts;  // [n_moe_layers * n_experts]: tokens of this step each expert served
};

}  // namespace moe
