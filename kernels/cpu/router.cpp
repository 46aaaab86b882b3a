#include "kernels/cpu/router.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

namespace moe::cpu {

void softmax_rows(float* x, int rows, int n) {
  for (int r = 0; r < rows; ++r) {
    float* v = x + int64_t(r) * n;
    const float mx = *std::max_element(v, v + n);
    float sum = 0.0f;
    for (int i = 0; i < n; ++i) {
      v[i] = std::exp(v[i] - mx);
      sum += v[i];
    }
    const float inv = 1.0f / sum;
    for (int i = 0; i < n; ++i) v[i] *= inv;
  }
}

void router_topk(const float* logits, int tokens, const RouterParams& p, int32_t* ids,
                 float* weights) {
  const int n = p.n_experts, k = p.top_k;
  std::vector<float> prob(n);
  std::vector<int> order(n);
  std::vector<bool> eligible(n);
  for (int t = 0; t < tokens; ++t) {
    std::copy(logits + int64_t(t) * n, logits + int64_t(t + 1) * n, prob.begin());
    softmax_rows(prob.data(), 1, n);
    std::fill(eligible.begin(), eligible.end(), true);
    if (p.n_group > 1) {
      const int per = n / p.n_group;
      std::vector<float> best(p.n_group);
      for (int g = 0; g < p.n_group; ++g)
        best[g] = *std::max_element(prob.begin() + g * per, prob.begin() + (g + 1) * per);
      std::vector<int> gorder(p.n_group);
      std::iota(gorder.begin(), gorder.end(), 0);
      std::stable_sort(gorder.begin(), gorder.end(),
                       [&](int a, int b) { return best[a] > best[b]; });
      std::fill(eligible.begin(), eligible.end(), false);
      for (int g = 0; g < p.topk_group; ++g)
        for (int e = gorder[g] * per; e < (gorder[g] + 1) * per; ++e) eligible[e] = true;
    }
    std::iota(order.begin(), order.end(), 0);
    std::partial_sort(order.begin(), order.begin() + k, order.end(), [&](int a, int b) {
      if (eligible[a] != eligible[b]) return bool(eligible[a]);
      if (prob[a] != prob[b]) return prob[a] > prob[b];
      return a < b;
    });
    float sum = 0.0f;
    for (int j = 0; j < k; ++j) sum += prob[order[j]];
    for (int j = 0; j < k; ++j) {
      ids[int64_t(t) * k + j] = order[j];
      float w = prob[order[j]];
      if (p.renormalize) w /= sum;
      weights[int64_t(t) * k + j] = w * p.scale;
    }
  }
}

}  // namespace moe::cpu
