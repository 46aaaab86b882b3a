#pragma once
// Token selection from one row of logits: greedy, or a seeded draw after
// temperature, min-p, top-k and top-p (docs/sampling.md has the order). The random number of a draw is a pure
// function of (seed, position), so a sequence samples the same tokens
// whether it runs alone or in a batch.

#include <cstdint>
#include <span>
#include <utility>
#include <vector>

#include "kernels/logit_adjust.h"
#include "kernels/sample_draw.h"

namespace moe::cpu {

// A uniform number in [0, 1) from (seed, position).
double sample_uniform(uint64_t seed, int64_t position);

// logits: [vocab]. Greedy picks the highest logit (the lowest id among equals).
int32_t sample_token(const float* logits, int vocab, const SampleDraw& p, int64_t position);

// The penalties and biases of `adjust` applied to `logits` [vocab] in place
// (adjusted_logit per listed token; ids outside the vocabulary are skipped).
void adjust_logits(float* logits, int vocab, std::span<const TokenAdjust> adjust, const Penalties& penalties);

// Tokens whose bit in `allowed` (ceil(vocab / 32) words; bit t % 32 of word
// t / 32) is clear get -inf.
void mask_logits(float* logits, int vocab, const uint32_t* allowed);

// log softmax of the raw logits at `token`. logits: [vocab].
float token_logprob(const float* logits, int vocab, int32_t token);

// The n most likely tokens with their raw log probabilities, best first.
std::vector<std::pair<int32_t, float>> top_logprobs(const float* logits, int vocab, int n);

}  // namespace moe::cpu
