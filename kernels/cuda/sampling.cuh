#pragma once
// Token selection on the GPU, the same rule as kernels/cpu/sampling.h:
// greedy (temperature <= 0 or top_k == 1: the highest logit, lowest id among
// equals), or a draw after temperature, min-p, top-k and top-p whose uniform number
// is the CPU twin's sample_uniform(seed, position), so both pick the same
// token from the same logits (up to rounding at a probability boundary).
// Candidates for top-k / top-p are the kMaxCandidates best tokens: top_k
// above that is clamped; top-p alone (top_k = 0) measures its threshold on
// the whole vocabulary but keeps at most kMaxCandidates tokens (a nucleus
// wider than that, rare with real logits, is cut there).

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/logit_adjust.h"
#include "kernels/sample_draw.h"
#include "model/result.h"

namespace moe::cuda {

constexpr int kMaxCandidates = 1024;

// logits: [rows, vocab] f32; params, positions: [rows] (device); tokens: [rows].
// spans (optional, [rows]): a row whose span names a mask (AdjustSpan::mask,
// a word offset into `masks`) draws only among the tokens whose bit is set;
// the logits are read, never changed.
Status sample_tokens(const float* logits, int rows, int vocab, const SampleDraw* params,
                     const int64_t* positions, int32_t* tokens, cudaStream_t stream,
                     const AdjustSpan* spans = nullptr, const uint32_t* masks = nullptr);

// The token adjustments of docs/sampling.md, in place, before the draw:
// row r's entries are entries[spans[r].first, + spans[r].count) (sorted,
// distinct tokens), each listed logit's value before the change goes to
// saved[entry] (the host puts them back for raw log probabilities). spans:
// [rows]; all pointers on the device.
Status adjust_logits(float* logits, int rows, int vocab, const AdjustSpan* spans, const TokenAdjust* entries,
                     float* saved, cudaStream_t stream);

// Greedy only: tokens[r] = argmax logits[r, :].
Status argmax_tokens(const float* logits, int rows, int vocab, int32_t* tokens, cudaStream_t stream);

}  // namespace moe::cuda
