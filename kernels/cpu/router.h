#pragma once
// MoE routing: softmax over a token's router logits, then its top-k experts.

#include <cstdint>

namespace moe::cpu {

struct RouterParams {
  int n_experts = 0;
  int top_k = 0;
  bool renormalize = false;  // divide the k weights by their sum
  float scale = 1.0f;        // multiplies the final weights (DeepSeek routed_scaling_factor)
  // Group-limited selection (DeepSeek "group_limited_greedy"): experts form
  // n_group equal groups; only the topk_group groups with the highest best
  // score are eligible. n_group = 1 disables it.
  int n_group = 1;
  int topk_group = 1;
};

// logits: [tokens, n_experts]; ids: [tokens, top_k] (best first; equal scores
// keep the lower expert index first); weights: [tokens, top_k].
void router_topk(const float* logits, int tokens, const RouterParams& p, int32_t* ids,
                 float* weights);

// In-place softmax of each row. x: [rows, n].
void softmax_rows(float* x, int rows, int n);

}  // namespace moe::cpu
