// The engine against transformers on every fixture architecture: logits of
// every prompt, hidden states layer by layer, router top-k sets, and greedy
// generation through the KV cache.

#include <algorithm>
#include <catch2/catch.hpp>
#include <map>
#include <numeric>
#include <set>
#include <tuple>

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

// The penalties' and biases' definitions applied to transformers' logits of
// each prompt's last position give the token the engine samples greedily
// with the same controls, and its reported log probability stays the raw
// model's. The prompt's tokens take the repetition penalty; the four best
// raw tokens are taken as generated before (counts 1..4: repetition,
// frequency and presence penalties); the best is banned, another lifted.
TEST_CASE("sampling controls turn transformers' logits as their definitions do", "[engine][fixtures][sampling]") {
  for (const char* arch : {"qwen3_moe", "mixtral", "olmoe"}) {
    DYNAMIC_SECTION(arch) {
      auto engine = make_engine(fixture_dir(arch));
      auto ref = Checkpoint::open_file(fixture_dir(arch) + "/reference.safetensors");
      REQUIRE(ref.ok());
      const int V = engine->desc().vocab_size;
      int checked = 0, moved = 0;  // moved: the controls chose another token than the ban alone would
      for (int p = 0; ref->find("p" + std::to_string(p) + ".input_ids"); ++p) {
        const std::string pre = "p" + std::to_string(p) + ".";
        const auto prompt = ints(*ref->find(pre + "input_ids"));
        const auto all = to_f32(*ref->find(pre + "logits"));
        const std::vector<float> raw(all.end() - V, all.end());
        std::vector<int32_t> order(static_cast<size_t>(V), 0);
        std::iota(order.begin(), order.end(), 0);
        std::partial_sort(order.begin(), order.begin() + 5, order.end(),
                          [&](int32_t a, int32_t b) { return raw[size_t(a)] > raw[size_t(b)]; });
        const int32_t banned = order[0], lifted = order[4];
        std::map<int32_t, int> output;  // the "earlier output"
        for (int k = 1; k <= 4; ++k) output[order[size_t(k)]] = k;
        for (auto [rep, freq, pres] : {std::tuple{1.0f, 0.0f, 0.0f}, std::tuple{1.3f, 0.0f, 0.0f},
                                       std::tuple{3.0f, 0.0f, 0.0f}, std::tuple{1.0f, 0.6f, 0.0f},
                                       std::tuple{1.0f, 0.0f, 1.5f}, std::tuple{1.2f, -0.4f, 0.8f}}) {
          // Reference: the definitions, on transformers' numbers.
          std::set<int32_t> seen(prompt.begin(), prompt.end());
          for (auto [t, c] : output) seen.insert(t);
          std::vector<float> want = raw;
          for (int32_t t : seen) want[size_t(t)] = want[size_t(t)] < 0 ? want[size_t(t)] * rep : want[size_t(t)] / rep;
          for (auto [t, c] : output) want[size_t(t)] -= freq * float(c) + pres;
          want[size_t(banned)] = -INFINITY;
          want[size_t(lifted)] += 0.25f;
          std::vector<float> sorted = want;
          std::sort(sorted.rbegin(), sorted.rend());
          if (sorted[0] - sorted[1] < 1e-2f * max_abs(raw)) continue;  // too close to call
          const int32_t expect = int32_t(std::max_element(want.begin(), want.end()) - want.begin());
          if (expect != order[1]) ++moved;

          SeqInput in;
          in.seq_id = 500 + uint64_t(p);
          in.tokens = prompt;
          in.sampling.temperature = 0;
          in.sampling.logprobs = true;
          in.sampling.penalties = {rep, pres, freq};
          std::map<int32_t, TokenAdjust> list;
          for (int32_t t : prompt) list[t] = TokenAdjust{t, 0.0f, 0, 1};
          for (auto [t, c] : output) {
            list[t].token = t;
            list[t].output_count = uint16_t(c);
          }
          list[banned].token = banned;
          list[banned].bias = -INFINITY;
          list[lifted].bias += 0.25f;
          for (auto& [t, a] : list) in.sampling.adjust.push_back(a);
          auto out = engine->step(std::span<const SeqInput>(&in, 1));
          REQUIRE(out.ok());
          INFO(arch << " prompt " << p << " repetition " << rep << " frequency " << freq << " presence " << pres);
          CHECK((*out)[0].token == expect);
          double lse = 0;
          const float mx = raw[size_t(order[0])];
          for (float l : raw) lse += std::exp(double(l - mx));
          const double raw_lp = double(raw[size_t(expect)] - mx) - std::log(lse);
          CHECK(std::abs((*out)[0].logprob - raw_lp) <= 2e-3 * std::max(1.0, std::abs(raw_lp)));
          engine->release(in.seq_id);
          ++checked;
        }
      }
      CHECK(checked >= 12);
      CHECK(moved >= 3);
    }
  }
}
