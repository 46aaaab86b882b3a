// Operations without sockets (docs/operations.md): priorities in the batch
// policy, the thermal governor's hysteresis, the keys file and rate limits.
#include <catch2/catch.hpp>

#include <algorithm>
#include <string>
#include <vector>

#include "gateway/api_keys.h"
#include "gateway/sched/scheduler_policy.h"
#include "tests/gateway/policy_test_parts.h"
#include "gateway/sched/thermal_governor.h"

using namespace moe::gw;
using moe::gw::test::answer;

namespace {

SequenceRequest req(int prompt_len, int max_new, int priority, uint64_t group, uint64_t submitted_ms = 1) {
  SequenceRequest r;
  for (int i = 0; i < prompt_len; ++i) r.prompt.push_back(1 + i);
  r.max_new_tokens = max_new;
  r.sampling.temperature = 0;
  r.priority = priority;
  r.group = group;
  r.submitted_ms = submitted_ms;
  return r;
}

PolicyLimits limits(int budget, int blocks) {
  PolicyLimits l;
  l.max_step_tokens = budget;
  l.kv_blocks_total = blocks;
  l.kv_block_tokens = 4;
  l.max_context = 1000;
  l.headroom_blocks = 1;
  l.grouped_batching = false;
  return l;
}

std::vector<uint64_t> ids(const StepPlan& p) {
  std::vector<uint64_t> v;
  for (const auto& c : p.chunks) v.push_back(c.seq_id);
  return v;
}

bool has(const std::vector<uint64_t>& v, uint64_t id) { return std::find(v.begin(), v.end(), id) != v.end(); }

// Two sequences of 8 tokens and 20 new at `priority`, admitted and prefilled.
void two_running(BatchPolicy& p, int priority, uint64_t submitted = 1, uint64_t now = 10) {
  p.add(1, req(8, 20, priority, 1, submitted));
  p.add(2, req(8, 20, priority, 2, submitted));
  StepPlan s = p.plan(nullptr, now);
  p.apply(s, answer(s), nullptr);
  REQUIRE(p.running() == 2);
}

moe::protocol::CardHealth sample(int temp, uint64_t reasons = 0) {
  static uint64_t seq = 0;
  moe::protocol::CardHealth h;
  h.sample_seq = ++seq;
  h.available = true;
  h.temperature_c = temp;
  h.throttle_reasons = reasons;
  return h;
}

}  // namespace

TEST_CASE("waiting sequences are admitted by priority, lower first, first come within one", "[operations][priority]") {
  BatchPolicy p(limits(8, 100));  // a budget of 8 tokens: one 8-token prompt a step
  p.add(1, req(8, 4, 10, 1));
  p.add(2, req(8, 4, 10, 2));
  p.add(3, req(8, 4, 0, 3));
  p.add(4, req(8, 4, 0, 4));
  std::vector<uint64_t> first;
  for (int i = 0; i < 4; ++i) {
    StepPlan s = p.plan(nullptr, 10);
    for (const auto& c : s.chunks)
      if (c.start_pos == 0) first.push_back(c.seq_id);
    p.apply(s, answer(s), nullptr);
  }
  REQUIRE(first.size() >= 3);
  CHECK(first[0] == 3);
  CHECK(first[1] == 4);
  CHECK(first[2] == 1);
}

TEST_CASE("a waiting earlier priority preempts running later ones when that makes room", "[operations][priority]") {
  // 6 blocks of 4 tokens: two 8-token prompts fill it with their headroom.
  BatchPolicy p(limits(64, 6));
  two_running(p, 5);
  StepPlan s;
  p.add(3, req(8, 4, 0, 3));
  s = p.plan(nullptr, 20);
  // The youngest of the later class goes; the urgent one starts.
  CHECK(has(s.release, 2));
  CHECK_FALSE(has(s.release, 1));
  CHECK(has(ids(s), 3));
  CHECK(p.priority_preemptions() == 1);
  // Nothing of its output is reported twice: it resumes where it was.
  const std::vector<int32_t> before = *p.generated(2);
  p.apply(s, answer(s), nullptr);
  CHECK(*p.generated(2) == before);

  SECTION("an equal or later priority preempts nobody") {
    p.add(4, req(8, 4, 9, 4));
    StepPlan t = p.plan(nullptr, 30);
    CHECK(t.release.empty());
    CHECK_FALSE(has(ids(t), 4));
  }
}

TEST_CASE("a full batch is room to make too, and preemption that cannot make it does nothing", "[operations][priority]") {
  PolicyLimits l = limits(64, 100);  // KV to spare
  l.max_batch_sequences = 2;
  BatchPolicy p(l);
  two_running(p, 5);
  StepPlan s;
  p.add(3, req(8, 4, 0, 3));
  s = p.plan(nullptr, 20);
  CHECK(s.release == std::vector<uint64_t>{2});  // a batch slot, from the youngest later one
  CHECK(has(ids(s), 3));
  SECTION("when the batch allows one sequence and it is urgent, nothing is preempted") {
    PolicyLimits one = l;
    one.max_batch_sequences = 1;
    BatchPolicy q(one);
    q.add(1, req(8, 20, 0, 1));
    StepPlan t = q.plan(nullptr, 10);
    q.apply(t, answer(t), nullptr);
    q.add(2, req(8, 4, 0, 2));
    t = q.plan(nullptr, 20);
    CHECK(t.release.empty());
    CHECK(q.priority_preemptions() == 0);
  }
}

TEST_CASE("preempting cannot make room: nobody is preempted in vain", "[operations][priority]") {
  BatchPolicy p(limits(64, 6));
  p.add(1, req(8, 20, 0, 1));  // urgent, running
  p.add(2, req(8, 20, 5, 2));  // later, running
  StepPlan s = p.plan(nullptr, 10);
  p.apply(s, answer(s), nullptr);
  REQUIRE(p.running() == 2);
  p.add(3, req(16, 4, 1, 3));  // needs 4 blocks + headroom: freeing seq 2 (3 blocks) is not enough
  s = p.plan(nullptr, 20);
  CHECK(s.release.empty());
  CHECK(p.priority_preemptions() == 0);
}

TEST_CASE("a sequence waiting past the starvation bound goes before later priorities", "[operations][priority]") {
  PolicyLimits l = limits(8, 100);
  l.priority_max_wait_ms = 1000;
  BatchPolicy p(l);
  p.add(1, req(8, 4, 10, 1, /*submitted*/ 100));   // old and of a later class
  p.add(2, req(8, 4, 0, 2, /*submitted*/ 2000));
  SECTION("within the bound, priority wins") {
    StepPlan s = p.plan(nullptr, 1050);
    CHECK(ids(s) == std::vector<uint64_t>{2});
  }
  SECTION("past it, the old one goes first") {
    StepPlan s = p.plan(nullptr, 2050);
    CHECK(ids(s) == std::vector<uint64_t>{1});
  }
  SECTION("and, running, it is not preempted for priority") {
    BatchPolicy q(limits(64, 6));
    PolicyLimits lq = limits(64, 6);
    lq.priority_max_wait_ms = 1000;
    q.set_limits(lq);
    two_running(q, 10, 100, 200);
    StepPlan s;
    q.add(3, req(8, 4, 0, 3, 2000));
    s = q.plan(nullptr, 2100);  // both running ones are 2 s old: the most urgent class
    CHECK(s.release.empty());
    CHECK(q.priority_preemptions() == 0);
  }
}

TEST_CASE("an aged sequence is admitted first but preempts no earlier or equal priority", "[operations][priority]") {
  PolicyLimits l = limits(64, 6);
  l.priority_max_wait_ms = 1000;
  for (int running_priority : {0, 5}) {
    BatchPolicy p(l);
    two_running(p, running_priority, 5000, 5100);
    StepPlan s;
    p.add(3, req(8, 4, 5, 3, /*submitted*/ 100));  // waited 5 s: past the bound
    s = p.plan(nullptr, 5200);
    CHECK(s.release.empty());
    CHECK(p.priority_preemptions() == 0);
  }
}

TEST_CASE("decode short of blocks preempts the latest priority, not merely the youngest", "[operations][priority]") {
  BatchPolicy p(limits(64, 7));
  p.add(1, req(7, 20, 5, 1));  // 2 blocks, older, later class
  p.add(2, req(7, 20, 0, 2));  // 2 blocks, younger, urgent
  StepPlan s = p.plan(nullptr, 10);
  p.apply(s, answer(s), nullptr);
  REQUIRE(p.running() == 2);
  // Decode until the blocks run out; the one released is always seq 1.
  for (int i = 0; i < 12; ++i) {
    s = p.plan(nullptr, 20);
    for (uint64_t r : s.release) CHECK(r == 1);
    p.apply(s, answer(s), nullptr);
  }
  CHECK(p.preemptions() >= 1);
}

TEST_CASE("take_if removes the sequences it selects, reporting the admitted ones", "[operations][fallback]") {
  BatchPolicy p(limits(64, 100));
  SequenceRequest a = req(4, 4, 0, 1), b = req(4, 4, 0, 2), c = req(4, 4, 0, 3);
  b.on_fallback = true;
  p.add(1, a);
  p.add(2, b);
  StepPlan s = p.plan(nullptr, 1);
  p.apply(s, answer(s), nullptr);
  p.add(3, c);
  CHECK(p.on_fallback() == 1);
  std::vector<uint64_t> released;
  auto out = p.take_if([](const SequenceRequest& r) { return !r.on_fallback; }, &released);
  REQUIRE(out.size() == 2);
  CHECK(out[0].id == 1);
  CHECK(out[1].id == 3);
  CHECK(released == std::vector<uint64_t>{1});
  CHECK(p.running() == 1);
  CHECK(p.waiting() == 0);
  CHECK(p.knows(2));
  CHECK_FALSE(out[0].generated.empty());  // what it produced travels with it
}

TEST_CASE("the thermal governor enters and leaves with hysteresis", "[operations][thermal]") {
  ThermalGovernor g({/*hot_c*/ 87, /*cool_margin_c*/ 5, /*enter*/ 2, /*leave*/ 3});
  CHECK_FALSE(g.observe(sample(90)));  // one hot sample is not enough
  CHECK_FALSE(g.observe(sample(80)));
  CHECK_FALSE(g.observe(sample(88)));
  CHECK(g.observe(sample(89)));  // two in a row
  CHECK(g.hot());
  CHECK(g.why() == "89 °C");
  // Just under the line is not cool: 5 degrees under, three samples in a row.
  for (int i = 0; i < 5; ++i) CHECK_FALSE(g.observe(sample(84)));
  CHECK_FALSE(g.observe(sample(82)));
  CHECK_FALSE(g.observe(sample(81)));
  CHECK_FALSE(g.observe(sample(60, moe::protocol::throttle::sw_thermal)));  // a thermal reason resets the run
  CHECK_FALSE(g.observe(sample(60)));
  CHECK_FALSE(g.observe(sample(60)));
  CHECK(g.observe(sample(60)));
  CHECK_FALSE(g.hot());
}

TEST_CASE("the same sample twice counts once", "[operations][thermal]") {
  ThermalGovernor g({87, 5, 2, 2});
  const moe::protocol::CardHealth hot = sample(95);
  CHECK_FALSE(g.observe(hot));
  CHECK_FALSE(g.observe(hot));  // a second stats reply before the next sample
  CHECK_FALSE(g.hot());
  CHECK(g.observe(sample(95)));
}

TEST_CASE("thermal throttle reasons make a card hot; a power cap or no NVML does not", "[operations][thermal]") {
  namespace t = moe::protocol::throttle;
  ThermalGovernor g({87, 5, 2, 2});
  for (int i = 0; i < 5; ++i) CHECK_FALSE(g.observe(sample(70, t::sw_power_cap | t::gpu_idle)));
  moe::protocol::CardHealth none;  // available = false
  none.temperature_c = 120;
  for (int i = 0; i < 5; ++i) CHECK_FALSE(g.observe(none));
  CHECK_FALSE(g.observe(sample(70, t::hw_slowdown)));
  CHECK(g.observe(sample(70, t::hw_slowdown | t::sw_power_cap)));
  CHECK(g.why() == "70 °C, hw_slowdown");
  CHECK(throttle_reason_names(t::sw_power_cap | t::hw_thermal) == "sw_power_cap,hw_thermal");
}

TEST_CASE("keys files: the columns, and errors that name the line", "[operations][keys]") {
  const std::string d = std::string(64, 'a');
  const std::string D = std::string(64, 'B');
  auto ok = parse_keys_file("# comment\n\nalice " + d + " 0 600\nbatch  " + D + "\t10 -\n", "keys");
  REQUIRE(ok.ok());
  REQUIRE(ok->size() == 2);
  CHECK((*ok)[0].name == "alice");
  CHECK((*ok)[0].rate_per_minute == 600);
  CHECK((*ok)[1].sha256_hex == std::string(64, 'b'));  // lower case
  CHECK((*ok)[1].priority == 10);
  CHECK((*ok)[1].rate_per_minute == 0);

  auto err = [](const std::string& text) {
    auto r = parse_keys_file(text, "keys");
    REQUIRE_FALSE(r.ok());
    return r.error();
  };
  CHECK_THAT(err("alice " + d + " 0\n"), Catch::Contains("keys:1") && Catch::Contains("4 columns"));
  CHECK_THAT(err("# c\nalice sk-plaintext-key 0 -\n"), Catch::Contains("keys:2") && Catch::Contains("SHA-256"));
  CHECK_THAT(err("alice " + d + " high -\n"), Catch::Contains("priority"));
  CHECK_THAT(err("alice " + d + " 5000 -\n"), Catch::Contains("priority"));
  CHECK_THAT(err("alice " + d + " 0 fast\n"), Catch::Contains("rate"));
  CHECK_THAT(err("alice " + d + " 0 -\nalice " + D + " 0 -\n"), Catch::Contains("twice"));
  CHECK_THAT(err("alice " + d + " 0 -\nbob " + d + " 0 -\n"), Catch::Contains("twice"));
  CHECK_THAT(err("al/ice " + d + " 0 -\n"), Catch::Contains("name"));
  CHECK_THAT(err("# nothing\n"), Catch::Contains("no keys"));
  CHECK_FALSE(load_keys_file("/nonexistent/keys").ok());
}

TEST_CASE("the rate limit is a bucket of a minute's requests, refilled evenly", "[operations][keys]") {
  KeyRateLimiter r;
  uint64_t wait = 0;
  CHECK(r.allow("a", 0, 0, &wait));  // unlimited
  for (int i = 0; i < 3; ++i) CHECK(r.allow("b", 3, 1000, &wait));
  CHECK_FALSE(r.allow("b", 3, 1000, &wait));
  CHECK(wait > 19'000);
  CHECK(wait <= 20'001);  // one request every 20 s
  CHECK_FALSE(r.allow("b", 3, 20'000, &wait));
  CHECK(r.allow("b", 3, 21'001, &wait));
  CHECK(r.allow("c", 3, 21'001, &wait));  // another key has its own bucket
}

TEST_CASE("fair shares: one caller's full batch makes room for another caller's waiting sequence",
          "[operations][fairness]") {
  // Room for 4 decoding sequences a step; KV to spare.
  PolicyLimits l = limits(4, 1000);
  BatchPolicy p(l);
  // Caller 7 fills the batch: four sequences of one request, decoding.
  for (uint64_t id = 1; id <= 4; ++id) {
    SequenceRequest r = req(2, 50, 0, 1);
    r.caller = 7;
    p.add(id, r);
  }
  for (int i = 0; i < 4; ++i) {
    StepPlan s = p.plan(nullptr, 10);
    p.apply(s, answer(s), nullptr);
  }
  REQUIRE(p.running() == 4);
  // Caller 9's one sequence comes: without fair shares it would wait for one
  // of 50 tokens to end. The youngest of caller 7's go back to wait their
  // turn, as many as its first chunk (2 tokens) needs of the step.
  SequenceRequest other = req(2, 5, 0, 2);
  other.caller = 9;
  p.add(5, other);
  StepPlan s = p.plan(nullptr, 20);
  CHECK(s.release == std::vector<uint64_t>{4, 3});
  CHECK(has(ids(s), 5));
  CHECK(p.fairness_preemptions() == 2);
  const std::vector<int32_t> before = *p.generated(4);
  p.apply(s, answer(s), nullptr);
  CHECK(*p.generated(4) == before);  // nothing reported twice
  // Caller 7 holds 2 and caller 9 one: the preempted ones, waiting again,
  // are caller 7's own and preempt nobody; they run once caller 9's ends.
  for (int i = 0; i < 8; ++i) {
    StepPlan t = p.plan(nullptr, 30 + i);
    CHECK(t.release.empty());
    p.apply(t, answer(t), nullptr);
  }
  CHECK(p.fairness_preemptions() == 2);
  CHECK(p.running() == 4);
  CHECK_FALSE(p.knows(5));  // its 5 tokens done

  SECTION("a caller holding one more than the other, or unknown callers, preempt nobody") {
    BatchPolicy q(l);
    for (uint64_t id = 1; id <= 4; ++id) {
      SequenceRequest r = req(2, 50, 0, id);
      r.caller = id <= 2 ? 7 : 9;  // two each
      q.add(id, r);
    }
    for (int i = 0; i < 4; ++i) {
      StepPlan t = q.plan(nullptr, 10);
      q.apply(t, answer(t), nullptr);
    }
    REQUIRE(q.running() == 4);
    SequenceRequest third = req(2, 5, 0, 5);
    third.caller = 9;  // caller 9 would hold 3 against 7's 2
    q.add(5, third);
    SequenceRequest unknown = req(2, 5, 0, 6);  // caller 0
    q.add(6, unknown);
    StepPlan t = q.plan(nullptr, 20);
    CHECK(t.release.empty());
    CHECK(q.fairness_preemptions() == 0);
  }
  SECTION("an earlier priority's sequences are not preempted for a later one's fair share") {
    BatchPolicy q(l);
    for (uint64_t id = 1; id <= 4; ++id) {
      SequenceRequest r = req(2, 50, 0, 1);
      r.caller = 7;
      q.add(id, r);
    }
    for (int i = 0; i < 4; ++i) {
      StepPlan t = q.plan(nullptr, 10);
      q.apply(t, answer(t), nullptr);
    }
    SequenceRequest later = req(2, 5, 5, 2);
    later.caller = 9;
    q.add(5, later);
    StepPlan t = q.plan(nullptr, 20);
    CHECK(t.release.empty());
    CHECK(q.fairness_preemptions() == 0);
  }
}

TEST_CASE("fair shares: a caller holding fewer running sequences is admitted first", "[operations][fairness]") {
  BatchPolicy p(limits(64, 1000));
  // Caller 7 runs two and has two more waiting (an earlier request).
  for (uint64_t id = 1; id <= 2; ++id) {
    SequenceRequest r = req(4, 50, 0, 1);
    r.caller = 7;
    p.add(id, r);
  }
  StepPlan s = p.plan(nullptr, 10);
  p.apply(s, answer(s), nullptr);
  for (uint64_t id = 3; id <= 4; ++id) {
    SequenceRequest r = req(4, 50, 0, 2);
    r.caller = 7;
    p.add(id, r);
  }
  // Caller 9's comes last, yet goes first: it holds none.
  SequenceRequest other = req(4, 5, 0, 3);
  other.caller = 9;
  p.add(5, other);
  REQUIRE(p.waiting_ids() == std::vector<uint64_t>{3, 4, 5});
  s = p.plan(nullptr, 20);
  std::vector<uint64_t> started;
  for (const auto& c : s.chunks)
    if (c.start_pos == 0) started.push_back(c.seq_id);
  REQUIRE_FALSE(started.empty());
  CHECK(started.front() == 5);
  CHECK(p.fairness_preemptions() == 0);  // there was room: nobody preempted
}
