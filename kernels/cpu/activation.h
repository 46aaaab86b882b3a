#pragma once
// The gated MLP activation: out = silu(gate) * up, silu(x) = x / (1 + e^-x).

#include <cstdint>

namespace moe::cpu {

// gate, up, out: [n] (out may alias gate or up).
void silu_mul(const float* gate, const float* up, float* out, int64_t n);

// Logistic sigmoid of one value (Qwen2-MoE shared-expert gate).
float sigmoid(float x);

}  // namespace moe::cpu
