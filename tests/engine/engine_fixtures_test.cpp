// The engine against transformers on every fixture architecture: logits of
// every prompt, hidden states layer by layer, router top-k sets, and greedy
// generation through the KV cache.

#include <algorithm>
#include <catch2/catch.hpp>
#include <numeric>
#include <set>

#include "tests/engine/reference_data.h"

using namespace moe;
using namespace moe::test;

namespace {

const char* const kArchs[] = {"qwen2_moe", "qwen3_moe",   "mixtral",
                              "olmoe",     "qwen2_dense", "deepseek_v2"};

std::set<int> top_set(const float* row, int n, int k) {
  std::vector<int> idx(static_cast<size_t>(n));
  std::iota(idx.begin(), idx.end(), 0);
  std::partial_sort(idx.begin(), idx.begin() + k, idx.end(),
                    [&](int a, int b) { return row[a] > row[b]; });
  return {idx.begin(), idx.begin() + k};
}

}  // namespace

TEST_CASE("engine logits, hidden states and routing match transformers on every fixture",
          "[engine][fixtures]") {
  for (const char* arch : kArchs) {
    DYNAMIC_SECTION(arch) {
      auto engine = make_engine(fixture_dir(arch));
      auto ref = Checkpoint::open_file(fixture_dir(arch) + "/reference.safetensors");
      REQUIRE(ref.ok());
      const ModelDesc& d = engine->desc();
      const int V = d.vocab_size;
      int prompts = 0, router_checked = 0;
      for (int p = 0; ref->find("p" + std::to_string(p) + ".input_ids"); ++p, ++prompts) {
        const std::string pre = "p" + std::to_string(p) + ".";
        const auto ids = ints(*ref->find(pre + "input_ids"));
        ForwardTrace trace;
        auto logits = engine->forward_logits(ids, &trace);
        REQUIRE(logits.ok());
        const auto want = to_f32(*ref->find(pre + "logits"));
        REQUIRE(logits->size() == want.size());
        const float tol = 1e-3f * max_abs(want);
        INFO(arch << " prompt " << p << " (" << ids.size() << " tokens)");
        CHECK(max_abs_diff(logits->data(), want.data(), want.size()) <= tol);

        for (int m = 0; m < d.n_moe_layers(); ++m) {
          const TensorView* rl = ref->find(pre + "router_logits." + std::to_string(m));
          if (!rl) continue;
          const auto want_r = to_f32(*rl);
          const int E = d.moe.n_experts, K = d.moe.top_k;
          REQUIRE(trace.router_logits.size() == size_t(d.n_moe_layers()));
          const std::vector<float>& got_r = trace.router_logits[size_t(m)];
          REQUIRE(got_r.size() == want_r.size());
          CHECK(max_abs_diff(got_r.data(), want_r.data(), want_r.size()) <=
                1e-3f * std::max(1.0f, max_abs(want_r)));
          for (size_t t = 0; t < ids.size(); ++t) {
            const float* w = &want_r[t * size_t(E)];
            std::vector<float> sorted(w, w + E);
            std::sort(sorted.rbegin(), sorted.rend());
            if (sorted[size_t(K) - 1] - sorted[size_t(K)] <= 1e-4f)
              continue;  // a near tie: either set is right
            INFO("moe layer " << m << " token " << t);
            CHECK(top_set(&got_r[t * size_t(E)], E, K) == top_set(w, E, K));
            ++router_checked;
          }
        }

        if (p == 0) {
          REQUIRE(trace.hidden.size() == size_t(d.n_layers) + 1);
          for (int l = 0; l <= d.n_layers; ++l) {
            const auto want_h = to_f32(*ref->find(pre + "hidden." + std::to_string(l)));
            INFO("hidden state " << l);
            REQUIRE(trace.hidden[size_t(l)].size() == want_h.size());
            CHECK(max_abs_diff(trace.hidden[size_t(l)].data(), want_h.data(), want_h.size()) <=
                  1e-3f * max_abs(want_h));
          }
        }
      }
      CHECK(prompts == 6);
      if (d.n_moe_layers() > 0 && std::string(arch) != "deepseek_v2") CHECK(router_checked > 0);
      (void)V;
    }
  }
}

TEST_CASE("greedy generation through the KV cache matches transformers",
          "[engine][fixtures][greedy]") {
  for (const char* arch : kArchs) {
    DYNAMIC_SECTION(arch) {
      auto engine = make_engine(fixture_dir(arch));
      auto ref = Checkpoint::open_file(fixture_dir(arch) + "/reference.safetensors");
      REQUIRE(ref.ok());
      for (int p = 0; ref->find("p" + std::to_string(p) + ".input_ids"); ++p) {
        const std::string pre = "p" + std::to_string(p) + ".";
        const auto prompt = ints(*ref->find(pre + "input_ids"));
        const auto want = ints(*ref->find(pre + "greedy_ids"));
        const auto margin = to_f32(*ref->find(pre + "greedy_margin"));
        SeqInput in;
        in.seq_id = 100 + uint64_t(p);
        in.tokens = prompt;
        in.start_pos = 0;
        in.sampling.temperature = 0;
        int compared = 0;
        for (size_t s = 0; s < want.size(); ++s) {
          auto out = engine->step(std::span<const SeqInput>(&in, 1));
          REQUIRE(out.ok());
          if (margin[s] < 1e-3f) break;  // the reference itself was a near tie here
          INFO(arch << " prompt " << p << " step " << s);
          REQUIRE((*out)[0].token == want[s]);
          ++compared;
          in.start_pos += int32_t(in.tokens.size());
          in.tokens = {(*out)[0].token};
        }
        CHECK(compared > 0);
        engine->release(in.seq_id);
      }
      CHECK(engine->kv_blocks_free() == engine->kv_blocks_total());
    }
  }
}
