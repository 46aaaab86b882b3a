#pragma once
// Token selection from one row of logits: greedy, or a seeded draw after
// temperature, top-k and top-p. The random number of a draw is a pure
// function of (seed, position), so a sequence samples the same tokens
// whether it runs alone or in a batch.

#include <cstdint>
#include <utility>
#include <vector>

#include "kernels/sample_draw.h"

namespace moe::cpu {

// A uniform number in [0, 1) from (seed, position).
double sample_uniform(uint64_t seed, int64_t position);

// logits: [vocab]. Greedy picks the highest logit (the lowest id among equals).
int32_t sample_token(const float* logits, int vocab, const SampleDraw& p, int64_t position);

// log softmax of the raw logits at `token`. logits: [vocab].
float token_logprob(const float* logits, int vocab, int32_t token);

// The n most likely tokens with their raw log probabilities, best first.
std::vector<std::pair<int32_t, float>> top_logprobs(const float* logits, int vocab, int n);

}  // namespace moe::cpu
