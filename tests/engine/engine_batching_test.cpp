// Batching and the KV cache: several sequences at different positions in one
// step give the same results as each alone; seeded sampling is reproducible;
// the block pool is accounted for and its exhaustion is an error.

#include <catch2/catch.hpp>
#include <map>

#include "tests/engine/reference_data.h"

using namespace moe;
using namespace moe::test;

namespace {

struct Trace {
  std::vector<int32_t> tokens;
  std::vector<std::vector<std::pair<int32_t, float>>> tops;
};

SeqInput input(uint64_t id, std::vector<int32_t> tokens, int32_t start, SamplingParams sp) {
  SeqInput in;
  in.seq_id = id;
  in.tokens = std::move(tokens);
  in.start_pos = start;
  in.sampling = sp;
  return in;
}

// Prompt then `steps` decode steps of one sequence, alone.
Trace run_alone(CpuEngine& e, uint64_t id, const std::vector<int32_t>& prompt, SamplingParams sp,
                int steps) {
  Trace tr;
  SeqInput in = input(id, prompt, 0, sp);
  for (int s = 0; s < steps; ++s) {
    auto out = e.step(std::span<const SeqInput>(&in, 1));
    REQUIRE(out.ok());
    tr.tokens.push_back((*out)[0].token);
    tr.tops.push_back((*out)[0].top);
    in.start_pos += int32_t(in.tokens.size());
    in.tokens = {(*out)[0].token};
  }
  e.release(id);
  return tr;
}

}  // namespace

TEST_CASE("sequences batched together give the same results as alone", "[engine][batching]") {
  for (const char* arch : {"qwen3_moe", "deepseek_v2", "qwen2_moe"}) {
    DYNAMIC_SECTION(arch) {
      auto e = make_engine(fixture_dir(arch));
      auto ref = Checkpoint::open_file(fixture_dir(arch) + "/reference.safetensors");
      REQUIRE(ref.ok());
      std::vector<std::vector<int32_t>> prompts;
      for (int p : {0, 1, 3, 5})
        prompts.push_back(ints(*ref->find("p" + std::to_string(p) + ".input_ids")));
      std::vector<SamplingParams> sps(4);
      sps[0].temperature = 0;
      auto draw = [](float temperature, float top_p, int top_k, uint64_t seed) {
        SamplingParams sp;
        sp.temperature = temperature;
        sp.top_p = top_p;
        sp.top_k = top_k;
        sp.seed = seed;
        sp.logprobs = true;
        return sp;
      };
      sps[1] = draw(0.8f, 0.9f, 0, 11);
      sps[2] = draw(1.2f, 1.0f, 20, 12);
      sps[3] = draw(1.0f, 1.0f, 0, 13);
      for (auto& sp : sps) sp.top_logprobs = 3;
      const int steps = 6;
      std::vector<Trace> alone;
      for (size_t i = 0; i < prompts.size(); ++i)
        alone.push_back(run_alone(*e, 7 + i, prompts[i], sps[i], steps));

      // Batched, and staggered: sequence i joins at step i, so the batch
      // mixes prefill chunks and decode tokens at different positions.
      std::vector<Trace> batched(prompts.size());
      std::vector<SeqInput> state(prompts.size());
      for (size_t i = 0; i < prompts.size(); ++i) state[i] = input(50 + i, prompts[i], 0, sps[i]);
      for (int round = 0; round < steps + int(prompts.size()); ++round) {
        std::vector<SeqInput> batch;
        std::vector<size_t> who;
        for (size_t i = 0; i < prompts.size(); ++i)
          if (int(i) <= round && int(batched[i].tokens.size()) < steps) {
            batch.push_back(state[i]);
            who.push_back(i);
          }
        if (batch.empty()) break;
        auto out = e->step(batch);
        REQUIRE(out.ok());
        for (size_t j = 0; j < who.size(); ++j) {
          const size_t i = who[j];
          batched[i].tokens.push_back((*out)[j].token);
          batched[i].tops.push_back((*out)[j].top);
          REQUIRE((*out)[j].seq_id == state[i].seq_id);
          state[i].start_pos += int32_t(state[i].tokens.size());
          state[i].tokens = {(*out)[j].token};
        }
      }
      for (size_t i = 0; i < prompts.size(); ++i) {
        INFO("sequence " << i);
        CHECK(batched[i].tokens == alone[i].tokens);
        for (int s = 0; s < steps; ++s) {
          REQUIRE(batched[i].tops[size_t(s)].size() == 3);
          for (int k = 0; k < 3; ++k) {
            CHECK(batched[i].tops[size_t(s)][size_t(k)].first ==
                  alone[i].tops[size_t(s)][size_t(k)].first);
            CHECK(std::abs(batched[i].tops[size_t(s)][size_t(k)].second -
                           alone[i].tops[size_t(s)][size_t(k)].second) <= 1e-6f);
          }
        }
      }
    }
  }
}

TEST_CASE("seeded sampling is reproducible and depends on the seed", "[engine][sampling]") {
  auto e = make_engine(fixture_dir("qwen3_moe"));
  const std::vector<int32_t> prompt = {5, 17, 300, 42};
  SamplingParams sp;
  sp.top_p = 0.95f;
  sp.seed = 1234;
  sp.logprobs = true;
  const Trace a = run_alone(*e, 1, prompt, sp, 16);
  const Trace b = run_alone(*e, 2, prompt, sp, 16);
  CHECK(a.tokens == b.tokens);
  sp.seed = 99;
  const Trace c = run_alone(*e, 3, prompt, sp, 16);
  CHECK(c.tokens != a.tokens);
  // Greedy equals the argmax of the full forward pass.
  SamplingParams greedy;
  greedy.temperature = 0;
  const Trace g = run_alone(*e, 4, prompt, greedy, 1);
  auto logits = e->forward_logits(prompt);
  REQUIRE(logits.ok());
  const int V = e->desc().vocab_size;
  const float* last = logits->data() + (prompt.size() - 1) * size_t(V);
  CHECK(g.tokens[0] == int32_t(std::max_element(last, last + V) - last));
}

TEST_CASE("the KV block pool: accounting, errors, release", "[engine][kv]") {
  EngineOptions opts;
  opts.kv_blocks = 4;
  opts.kv_block_tokens = 8;
  opts.prefix_cache = false;  // every token computed, every block counted (the cache: its own test)
  auto e = make_engine(fixture_dir("qwen3_moe"), opts);
  CHECK(e->kv_blocks_total() == 4);
  CHECK(e->kv_block_tokens() == 8);
  SamplingParams greedy;
  greedy.temperature = 0;

  std::vector<int32_t> prompt(17, 7);  // 17 tokens: 3 blocks of 8
  SeqInput a = input(1, prompt, 0, greedy);
  REQUIRE(e->step(std::span<const SeqInput>(&a, 1)).ok());
  CHECK(e->kv_blocks_free() == 1);
  CHECK(e->seq_length(1) == 17);

  // A wrong start position is refused and changes nothing.
  SeqInput bad = input(1, {3}, 5, greedy);
  auto r = e->step(std::span<const SeqInput>(&bad, 1));
  CHECK_FALSE(r.ok());
  CHECK(e->seq_length(1) == 17);

  // A second sequence that needs 2 blocks does not fit: an error, no change.
  SeqInput b = input(2, std::vector<int32_t>(9, 4), 0, greedy);
  r = e->step(std::span<const SeqInput>(&b, 1));
  CHECK_FALSE(r.ok());
  CHECK(e->kv_blocks_free() == 1);
  CHECK(e->seq_length(2) == -1);

  // The same id twice in one step is refused.
  SeqInput a2 = input(1, {3}, 17, greedy);
  std::vector<SeqInput> twice = {a2, a2};
  CHECK_FALSE(e->step(twice).ok());

  e->release(1);
  CHECK(e->kv_blocks_free() == 4);
  REQUIRE(e->step(std::span<const SeqInput>(&b, 1)).ok());
  CHECK(e->kv_blocks_free() == 2);
  // Starting an id afresh at position 0 reuses its blocks.
  REQUIRE(e->step(std::span<const SeqInput>(&b, 1)).ok());
  CHECK(e->kv_blocks_free() == 2);

  // Expert counts: every token of the step is routed to top_k experts per layer.
  auto out = e->step(std::span<const SeqInput>(&b, 1));
  REQUIRE(out.ok());
  const ModelDesc& d = e->desc();
  REQUIRE((*out)[0].expert_counts.size() == size_t(d.n_moe_layers() * d.moe.n_experts));
  for (int m = 0; m < d.n_moe_layers(); ++m) {
    int sum = 0;
    for (int x = 0; x < d.moe.n_experts; ++x)
      sum += (*out)[0].expert_counts[size_t(m * d.moe.n_experts + x)];
    CHECK(sum == 9 * d.moe.top_k);
  }
}

TEST_CASE("score_token reports the raw log probability of a given next token", "[engine][score]") {
  auto e = make_engine(fixture_dir("qwen3_moe"));
  const std::vector<int32_t> prompt = {5, 17, 300, 42, 9, 77};
  auto logits = e->forward_logits(prompt);
  REQUIRE(logits.ok());
  const int V = e->desc().vocab_size;
  const float* last = logits->data() + size_t(prompt.size() - 1) * V;
  const float mx = *std::max_element(last, last + V);
  double z = 0;
  for (int i = 0; i < V; ++i) z += std::exp(double(last[i] - mx));
  for (int32_t next : {0, 123, V - 1}) {
    SeqInput in = input(1, prompt, 0, SamplingParams{});
    in.score_token = next;
    auto out = e->step(std::span<const SeqInput>(&in, 1));
    REQUIRE(out.ok());
    const double want = double(last[next] - mx) - std::log(z);
    CHECK(std::abs((*out)[0].score_logprob - want) < 1e-4);
    e->release(1);
  }
}

TEST_CASE("prefix cache: a prompt that starts like a released one computes only the rest, and samples the same",
          "[engine][prefix]") {
  EngineOptions on, off;
  on.kv_block_tokens = off.kv_block_tokens = 16;
  off.prefix_cache = false;
  auto cached = make_engine(fixture_dir("qwen3_moe"), on);
  auto fresh = make_engine(fixture_dir("qwen3_moe"), off);
  std::vector<int32_t> system(40), question = {11, 12, 13, 14, 15};
  for (size_t i = 0; i < system.size(); ++i) system[i] = int32_t(3 + (i * 37) % 200);
  SamplingParams sp;
  sp.temperature = 0;
  sp.logprobs = true;
  sp.top_logprobs = 3;
  // A first request, released: its two whole blocks stay cached.
  SeqInput first = input(1, system, 0, sp);
  REQUIRE(cached->step(std::span<const SeqInput>(&first, 1)).ok());
  cached->release(1);
  // A second, sharing the first 40 tokens: 32 come from the cache.
  std::vector<int32_t> prompt = system;
  prompt.insert(prompt.end(), question.begin(), question.end());
  SeqInput a = input(2, prompt, 0, sp), b = input(2, prompt, 0, sp);
  for (int s = 0; s < 5; ++s) {
    auto ra = cached->step(std::span<const SeqInput>(&a, 1));
    auto rb = fresh->step(std::span<const SeqInput>(&b, 1));
    REQUIRE((ra.ok() && rb.ok()));
    const SeqOutput &x = (*ra)[0], &y = (*rb)[0];
    INFO("step " << s);
    CHECK(x.cached_tokens == (s == 0 ? 32 : 0));
    CHECK(y.cached_tokens == 0);
    CHECK(x.token == y.token);
    CHECK(std::abs(x.logprob - y.logprob) < 1e-4f);
    REQUIRE(x.top.size() == y.top.size());
    for (size_t k = 0; k < x.top.size(); ++k) {
      CHECK(x.top[k].first == y.top[k].first);
      CHECK(std::abs(x.top[k].second - y.top[k].second) < 1e-4f);
    }
    const int pos = a.start_pos + int(a.tokens.size());
    a = input(2, {x.token}, pos, sp);
    b = input(2, {y.token}, pos, sp);
  }
  CHECK(cached->seq_length(2) == int(prompt.size()) + 4);
}
