#pragma once
// How well a MoE layer's experts can be known before the layer runs
// (docs/expert-prediction.md, "Layer-ahead prediction"): the layer's own
// router applied, after the layer's own MLP norm, to a hidden state that
// exists earlier, against the experts it then chooses. Measured on the CPU
// engine's ForwardTrace of real text; compared with two baselines learned
// online over the same tokens: the transition table (experts of layer t−1
// to those of t, as residency/expert_predictor.h predicts) and each layer's
// most used experts so far.

#include <cstdint>
#include <vector>

#include "engine/forward.h"
#include "engine/weights.h"
#include "model/model_config.h"

namespace moe {

// Mean recall of the true top-k (the fraction of a token's k experts among
// the k guessed), per MoE layer; `tokens` scored.
struct LookaheadLayer {
  int layer = 0;  // the model's layer index
  uint64_t tokens = 0;
  double after_attention_prev = 0;     // from layer t−1's residual after its attention (during t−1's MoE)
  double after_attention_prev_2k = 0;  // the same with 2k guesses
  double entering = 0;                 // from the residual entering layer t (during t's attention)
  double two_ahead = 0;                // from layer t−2's residual after its attention
  double transition = 0;               // the transition table on the previous MoE layer's true experts
                                       // (none for the first MoE layer)
  double frequency = 0;                // layer t's most used experts so far
};

class RouterLookahead {
 public:
  RouterLookahead(const ModelDesc& d, const ModelWeights& w);
  // One forward pass's trace over `tokens` tokens (hidden, mid and router
  // logits filled), scored in token order.
  void add(const ForwardTrace& trace, int tokens);
  // Per MoE layer (the first has no layer before it: only `entering` and
  // `frequency`), the means so far.
  std::vector<LookaheadLayer> layers() const;
  // The k experts `layer`'s router ranks first for one token's `hidden`
  // (the layer's MLP norm first): the guess above from any hidden state;
  // from the layer's own residual after attention it is the router's choice.
  std::vector<int> guess(int layer, const float* hidden, int k) const;
  // The router's k experts for one token's n_experts logits, as the CPU
  // engine routes (cpu::router_topk: group-limited where the model asks).
  std::vector<int> route(const float* logits, int k) const;
  // The k largest of n_experts scores, best first (ties: lower id): the
  // baselines' guesses from counts.
  std::vector<int> top(const float* scores, int k) const;

 private:
  const ModelDesc& d_;
  const ModelWeights& w_;
  int E_, K_;
  cpu::RouterParams router_;  // the model's routing rule (top_k set per call)
  std::vector<LookaheadLayer> sums_;            // [moe layer]: sums of recall
  std::vector<std::vector<uint32_t>> trans_;    // [moe layer][from * E + to]: layer t−1 → t
  std::vector<std::vector<uint64_t>> used_;     // [moe layer][expert]
};

}  // namespace moe
