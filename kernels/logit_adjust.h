#pragma once
// Per-token changes to a row of logits before the draw (docs/sampling.md):
// the repetition, frequency and presence penalties over the tokens a
// sequence has seen, and a bias (logit_bias; -inf bans a token). One plain
// form from the step frame down to both kernels, and the one rule both
// apply (the device compiles it too).

#include <cstdint>

#if defined(__CUDACC__)
#define MOE_HOST_DEVICE __host__ __device__
#else
#define MOE_HOST_DEVICE
#endif

namespace moe {

// One token of a row's adjustment list. Lists are sorted by token, distinct.
struct TokenAdjust {
  int32_t token = 0;
  float bias = 0.0f;          // added last; -inf: never drawn
  uint16_t output_count = 0;  // times the sequence generated it (saturating)
  uint8_t in_prompt = 0;      // 1: the prompt holds it (the repetition penalty applies)
  uint8_t reserved = 0;
#if __cplusplus >= 202002L  // the CUDA sources are C++17
  bool operator==(const TokenAdjust&) const = default;
#endif
};
static_assert(sizeof(TokenAdjust) == 12);

struct Penalties {
  float repetition = 1.0f;  // > 0; 1: off
  float presence = 0.0f;    // subtracted once from a token the output holds
  float frequency = 0.0f;   // subtracted per time the output holds it
#if __cplusplus >= 202002L
  bool operator==(const Penalties&) const = default;
#endif
};

inline constexpr uint32_t kNoMask = 0xffffffffu;

// Where one sampled row's entries (and its mask of allowed tokens, a word
// offset; kNoMask: none) sit in a pass's lists (the GPU pass pack).
struct AdjustSpan {
  uint32_t first = 0;
  uint32_t count = 0;
  Penalties penalties;
  uint32_t mask = kNoMask;
};

MOE_HOST_DEVICE inline float adjusted_logit(float l, const TokenAdjust& a, const Penalties& p) {
  if (p.repetition != 1.0f && (a.in_prompt || a.output_count > 0)) l = l > 0.0f ? l / p.repetition : l * p.repetition;
  if (a.output_count > 0) l -= p.frequency * float(a.output_count) + p.presence;
  return l + a.bias;
}

}  // namespace moe
