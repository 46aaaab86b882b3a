// Layer-ahead expert guesses (engine/router_lookahead.h) on the demo model,
// whose routing was really trained: the guess from a layer's own residual
// after attention is exactly the router's choice, and the guesses from one
// layer back beat both routing-only baselines on held-out text.
#include <catch2/catch.hpp>

#include "engine/router_lookahead.h"
#include "tests/engine/reference_data.h"

using namespace moe;
using namespace moe::test;

TEST_CASE("router lookahead: the router on its own input is its choice; one layer back beats the baselines",
          "[engine][demo][lookahead]") {
  auto e = make_engine(demo_dir());
  const ModelDesc& d = e->desc();
  const auto ids = demo_eval_ids(1024);
  RouterLookahead la(d, e->weights());
  const int E = d.moe.n_experts, K = d.moe.top_k, H = d.hidden_size;
  int exact = 0, scored = 0;
  for (size_t at = 0; at < ids.size(); at += 512) {
    ForwardTrace trace;
    auto r = e->forward_logits(std::span<const int32_t>(ids.data() + at, 512), &trace);
    REQUIRE(r.ok());
    REQUIRE(trace.mid.size() == size_t(d.n_layers));
    for (int l = 0; l < d.n_layers; ++l) {
      const int m = d.moe_layer_index(l);
      if (m < 0) continue;
      for (int t = 0; t < 512; t += 7) {
        const auto truth = la.route(trace.router_logits[size_t(m)].data() + size_t(t) * E, K);
        exact += la.guess(l, trace.mid[size_t(l)].data() + size_t(t) * H, K) == truth;
        ++scored;
      }
    }
    la.add(trace, 512);
  }
  CHECK(exact == scored);
  double prev = 0, transition = 0, frequency = 0;
  int n = 0;
  for (const LookaheadLayer& s : la.layers()) {
    CHECK(s.tokens == ids.size());
    for (double v : {s.after_attention_prev, s.after_attention_prev_2k, s.entering, s.two_ahead, s.transition,
                     s.frequency}) {
      CHECK(v >= 0.0);
      CHECK(v <= 1.0);
    }
    if (s.layer < 1 || s.layer == la.layers().front().layer) continue;  // no previous layer / MoE layer
    prev += s.after_attention_prev;
    transition += s.transition;
    frequency += s.frequency;
    ++n;
  }
  REQUIRE(n > 0);
  INFO("one layer back " << prev / n << ", transition " << transition / n << ", frequency " << frequency / n);
  CHECK(prev / n > transition / n + 0.1);
  CHECK(prev / n > frequency / n + 0.2);
}
