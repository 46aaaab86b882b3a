#pragma once
// Rotary position embeddings. The frequency table is computed once per model
// (rope_inv_freq_* below, or by the caller for other scalings); the apply
// functions rotate q or k in place for each token's own position.

#include <cstdint>
#include <vector>

namespace moe::cpu {

// Default RoPE frequencies: inv_freq[i] = 1 / theta^(2i / rot_dim), i < rot_dim/2.
std::vector<float> rope_inv_freq_default(float theta, int rot_dim);

// YaRN frequencies (Hugging Face `_compute_yarn_parameters`): returns
// inv_freq [rot_dim/2]; *attention_factor receives the cos/sin scale.
std::vector<float> rope_inv_freq_yarn(float theta, int rot_dim, float factor,
                                      int original_max_position, float beta_fast, float beta_slow,
                                      float mscale, float mscale_all_dim, float* attention_factor);

// Rotate-half ("neox") layout, as HF Llama/Qwen/Mixtral/OLMoE: the pair of
// element i is element i + rot_dim/2. Rotates the first rot_dim values of
// each head, in place.
// x: [tokens, heads, head_dim] (token stride token_stride floats, head stride
// head_stride floats), positions: [tokens], inv_freq: [rot_dim/2].
// cos/sin are scaled by attention_factor (1 except for YaRN).
void rope_neox(float* x, int64_t token_stride, int64_t head_stride, const int32_t* positions,
               int tokens, int heads, int rot_dim, const float* inv_freq,
               float attention_factor = 1.0f);

// Interleaved layout (DeepSeek-V2's complex-number form): the pair of element
// 2i is element 2i+1. Same arguments as rope_neox.
void rope_interleaved(float* x, int64_t token_stride, int64_t head_stride, const int32_t* positions,
                      int tokens, int heads, int rot_dim, const float* inv_freq,
                      float attention_factor = 1.0f);

}  // namespace moe::cpu
