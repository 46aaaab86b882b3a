#pragma once
// What a sampled row's draw takes, in one form from the step contract
// (engine/step.h's SamplingParams is one) down to both kernels
// (kernels/cpu/sampling.h, kernels/cuda/sampling.cuh): a plain struct the
// device reads as it is laid out on the host.

#include <cstdint>

namespace moe {

struct SampleDraw {
  // Positional initialisers in use: append new fields at the end.
  float temperature = 1.0f;  // <= 0: greedy
  float top_p = 1.0f;        // keep the smallest set of best tokens whose probability reaches top_p
  int top_k = 0;             // 0: no limit
  uint64_t seed = 0;
  float min_p = 0.0f;        // drop tokens below min_p x the best token's probability (after temperature)
};

}  // namespace moe
