#include "engine/perplexity.h"

#include <algorithm>
#include <cmath>

namespace moe {

Result<NllResult> mean_nll(CpuEngine& engine, std::span<const int32_t> ids, int ctx,
                           const std::function<void(int64_t, int64_t)>& progress) {
  if (ctx < 1) return make_error("ctx must be at least 1");
  if (ids.size() < 2) return make_error("need at least two tokens");
  const int V = engine.desc().vocab_size;
  const int64_t total = int64_t(ids.size()) - 1;
  double sum = 0;
  int64_t n = 0;
  for (int64_t begin = 0; begin < total; begin += ctx) {
    const int64_t end = std::min<int64_t>(begin + ctx, total);  // last id of the window
    auto window = ids.subspan(size_t(begin), size_t(end - begin + 1));
    auto logits = engine.forward_logits(window);
    if (!logits) return make_error(logits.error());
    for (size_t t = 0; t + 1 < window.size(); ++t) {
      const float* row = logits->data() + t * size_t(V);
      const float mx = *std::max_element(row, row + V);
      double s = 0;
      for (int i = 0; i < V; ++i) s += std::exp(double(row[i]) - mx);
      sum += mx + std::log(s) - double(row[window[t + 1]]);
      ++n;
    }
    if (progress) progress(n, total);
  }
  return NllResult{sum / double(n), n};
}

}  // namespace moe
