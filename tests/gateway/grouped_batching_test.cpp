// Expert-grouped batching in BatchPolicy: when more sequences compete for a
// step than its budget takes, the ones sharing the step's predicted experts
// go first; none is passed over more than grouping_max_skips times; without
// predictions the order stays first come first served.
#include <catch2/catch.hpp>
#include <string>
#include <vector>

#include "gateway/sched/scheduler_policy.h"

using namespace moe::gw;

namespace {

constexpr size_t kExperts = 64;

SequenceRequest req(int prompt_len, int max_new) {
  SequenceRequest r;
  for (int i = 0; i < prompt_len; ++i) r.prompt.push_back(1 + i);
  r.max_new_tokens = max_new;
  r.sampling.temperature = 0;
  return r;
}

SequenceHints hints(std::vector<size_t> experts, uint64_t tag = 0) {
  SequenceHints h;
  h.experts = ExpertSet(kExperts);
  for (size_t e : experts) h.experts.add(e);
  h.route_tag = tag;
  return h;
}

PolicyLimits limits(int budget, bool grouped, int max_skips = 4) {
  PolicyLimits l;
  l.max_step_tokens = budget;
  l.kv_blocks_total = 1000;
  l.kv_block_tokens = 4;
  l.max_context = 1000;
  l.grouped_batching = grouped;
  l.grouping_max_skips = max_skips;
  return l;
}

std::string picture(const StepPlan& p) {
  std::string s;
  for (const auto& c : p.chunks) {
    if (!s.empty()) s += ' ';
    s += std::to_string(c.seq_id) + ":" + std::to_string(c.start_pos) + "+" +
         std::to_string(c.tokens.size()) + (c.sample ? "s" : "");
  }
  return s;
}

std::vector<ChunkResult> answer(const StepPlan& p) {
  std::vector<ChunkResult> out;
  for (const auto& c : p.chunks) {
    ChunkResult r;
    r.seq_id = c.seq_id;
    r.sampled = c.sample;
    r.token.token = 7;
    out.push_back(r);
  }
  return out;
}

}  // namespace

TEST_CASE("admission picks the waiting request that shares the step's experts",
          "[scheduler][grouping]") {
  for (bool grouped : {true, false}) {
    BatchPolicy p(limits(8, grouped));
    p.add(1, req(4, 5), hints({0, 1, 2}, 11));
    p.add(2, req(4, 5), hints({40, 41, 42}, 22));
    p.add(3, req(4, 5), hints({0, 1, 3}, 33));
    const StepPlan plan = p.plan();
    // 1 is oldest (nothing to overlap with yet); then 3 shares two of 1's experts.
    CHECK(picture(plan) == (grouped ? "1:0+4s 3:0+4s" : "1:0+4s 2:0+4s"));
    // The bucket tag rides with each chunk.
    CHECK(plan.chunks[0].route_tag == 11);
    CHECK(plan.chunks[1].route_tag == (grouped ? 33u : 22u));
    if (grouped) CHECK(p.skips(2) == 1);
  }
}

TEST_CASE("decoding sequences' experts steer which prefill chunk fills the budget",
          "[scheduler][grouping]") {
  BatchPolicy p(limits(9, true));
  p.add(1, req(1, 50), hints({5, 6}));
  StepPlan s = p.plan();
  REQUIRE(picture(s) == "1:0+1s");  // from now on 1 decodes every step
  std::vector<uint64_t> rel;
  (void)p.apply(s, answer(s), &rel);
  p.add(2, req(12, 5), hints({30, 31}));
  p.add(3, req(12, 5), hints({5, 6}));
  // Step: 1 decodes (1 token), 2 is the head but 3 shares 1's experts: 3 takes the 8 left.
  s = p.plan();
  CHECK(picture(s) == "1:1+1s 3:0+8");
  (void)p.apply(s, answer(s), &rel);
  // 3's last chunk fits beside the decode, and 2 gets what is left.
  s = p.plan();
  CHECK(picture(s) == "1:2+1s 3:8+4s 2:0+4");
}

TEST_CASE("a request passed over grouping_max_skips times goes next: no starvation",
          "[scheduler][grouping]") {
  for (int max_skips : {0, 1, 2, 5}) {
    BatchPolicy p(limits(5, true, max_skips));
    // 1 decodes forever with experts {0}; every step a new request sharing
    // them arrives, and one request (2) shares nothing.
    p.add(1, req(1, 1000), hints({0}));
    p.add(2, req(4, 1), hints({50}));
    uint64_t next = 3;
    int admitted_at = -1;
    std::vector<uint64_t> rel;
    for (int step = 0; step < 20 && admitted_at < 0; ++step) {
      p.add(next, req(4, 1), hints({0})), ++next;
      const StepPlan s = p.plan();
      for (const auto& c : s.chunks)
        if (c.seq_id == 2) admitted_at = step;
      (void)p.apply(s, answer(s), &rel);
    }
    INFO("max_skips " << max_skips);
    // Step 0 admits 1 (the oldest) and then one of the budget's 4 tokens
    // worth; 2 is overtaken once per step until its skips reach the bound.
    REQUIRE(admitted_at >= 0);
    CHECK(admitted_at <= max_skips + 1);
    if (max_skips > 0) CHECK(admitted_at >= 1);  // it was passed over at least once
  }
}

TEST_CASE("without predictions grouped batching keeps first come first served",
          "[scheduler][grouping]") {
  BatchPolicy a(limits(6, true)), b(limits(6, false));
  for (uint64_t id = 1; id <= 5; ++id) {
    a.add(id, req(3, 2));
    b.add(id, req(3, 2));
  }
  std::vector<uint64_t> rel;
  for (int step = 0; step < 10; ++step) {
    const StepPlan sa = a.plan(), sb = b.plan();
    CHECK(picture(sa) == picture(sb));
    (void)a.apply(sa, answer(sa), &rel);
    (void)b.apply(sb, answer(sb), &rel);
  }
}
