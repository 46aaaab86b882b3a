// BatchPolicy without sockets: what each step holds, iteration by iteration.
#include <catch2/catch.hpp>

#include <limits>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "gateway/sched/scheduler_policy.h"
#include "tests/gateway/policy_test_parts.h"

using namespace moe::gw;
using moe::gw::test::answer;

namespace {

SequenceRequest req(int prompt_len, int max_new, int first_token = 1) {
  SequenceRequest r;
  for (int i = 0; i < prompt_len; ++i) r.prompt.push_back(first_token + i);
  r.max_new_tokens = max_new;
  r.sampling.temperature = 0;
  return r;
}

// "id:start+len[s]" per chunk, in step order: a compact picture of a step.
std::string picture(const StepPlan& p) {
  std::string s;
  for (const auto& c : p.chunks) {
    if (!s.empty()) s += ' ';
    s += std::to_string(c.seq_id) + ":" + std::to_string(c.start_pos) + "+" + std::to_string(c.tokens.size()) +
         (c.sample ? "s" : "");
  }
  return s;
}

PolicyLimits limits(int budget, int blocks, int block_tokens = 4) {
  PolicyLimits l;
  l.max_step_tokens = budget;
  l.kv_blocks_total = blocks;
  l.kv_block_tokens = block_tokens;
  l.max_context = 1000;
  l.headroom_blocks = 1;
  return l;
}

}  // namespace

TEST_CASE("chunked prefill stays under the per-step token budget, decodes ride along", "[scheduler][policy]") {
  BatchPolicy p(limits(8, 100));
  p.add(1, req(5, 3));
  p.add(2, req(12, 2));
  // Iteration table: the step's picture after each apply().
  // Blocks of 4 tokens: a chunk that does not end its prompt ends on a
  // block boundary.
  const std::vector<std::string> expected = {
      "1:0+5s",          // 1 prefills whole (5); the 3 left would end 2's chunk mid-block: 2 waits
      "1:5+1s 2:0+4",    // 1 decodes (1 token), 2 prefills the whole blocks of 7 = budget - 1
      "1:6+1s 2:4+4",    // the same
      "2:8+4s",          // 1 finished after 3 tokens (length); 2's last chunk samples
      "2:12+1s",
  };
  std::vector<std::string> got;
  std::vector<FinishReason> finished;
  for (int it = 0; it < 10; ++it) {
    StepPlan plan = p.plan();
    if (plan.chunks.empty()) break;
    int tokens = 0;
    for (const auto& c : plan.chunks) tokens += int(c.tokens.size());
    CHECK(tokens <= 8);
    got.push_back(picture(plan));
    std::vector<uint64_t> rel;
    for (const auto& u : p.apply(plan, answer(plan), &rel))
      if (u.finished) finished.push_back(u.reason);
  }
  CHECK(got == expected);
  CHECK(finished == std::vector<FinishReason>{FinishReason::length, FinishReason::length});
  CHECK(p.running() == 0);
  CHECK(p.waiting() == 0);
}

TEST_CASE("a prefill chunk that does not end its prompt ends on a KV block boundary; the oldest always moves",
          "[scheduler][policy]") {
  // The worker's prefix cache continues a prompt's chain of cached blocks
  // only while its blocks so far are whole: the n choices of one prompt
  // share its KV only if no chunk of theirs ends mid-block, whatever small
  // requests take of a step's budget.
  auto run = [](BatchPolicy& p) {
    std::vector<std::string> got;
    for (int it = 0; it < 20; ++it) {
      StepPlan plan = p.plan();
      if (plan.chunks.empty()) break;
      got.push_back(picture(plan));
      std::vector<uint64_t> released;
      p.apply(plan, answer(plan), &released);
    }
    return got;
  };
  SECTION("a choice of the same prompt behind a short request") {
    BatchPolicy p(limits(10, 100));
    p.add(1, req(3, 3));
    p.add(2, req(20, 1));
    p.add(3, req(20, 1));
    CHECK(run(p) == std::vector<std::string>{
                        "1:0+3s 2:0+4",   // 7 left: 2 takes its whole block (4), 3 waits (3 would end mid-block)
                        "1:3+1s 2:4+8",   // 9 left: two whole blocks
                        "1:4+1s 2:12+8s",  // 2's last chunk samples, whatever its length
                        "3:0+8",          // 3 (its prompt 2's: a worker would serve these blocks cached)
                        "3:8+8",
                        "3:16+4s",
                    });
  }
  SECTION("less than a block of budget: the oldest prefill still moves, a younger one waits") {
    BatchPolicy p(limits(3, 100));
    p.add(1, req(10, 1));
    p.add(2, req(6, 1));
    // 1 (10 tokens) moves as the step's first prefill even when its chunk
    // ends mid-block (3 of a block of 4), back on a boundary where the
    // budget reaches one (3 + 1); 2 starts when 1 is done.
    CHECK(run(p) == std::vector<std::string>{"1:0+3", "1:3+1", "1:4+3", "1:7+3s", "2:0+3", "2:3+3s"});
  }
}

TEST_CASE("admission waits until the KV blocks hold the prompt plus headroom", "[scheduler][policy]") {
  // 6 blocks of 4 tokens. Prompt of 9 tokens: 3 blocks (+1 headroom when others run).
  BatchPolicy p(limits(64, 6));
  p.add(1, req(9, 4));
  p.add(2, req(9, 4));
  p.add(3, req(2, 1));
  StepPlan s1 = p.plan();
  // 1 is admitted (4 blocks incl. its first decode); 2 needs 3 + 1 headroom more: 4 + 4 > 6 -> waits,
  // and so does 3 behind it (first come, first served).
  CHECK(picture(s1) == "1:0+9s");
  CHECK(p.running_ids() == std::vector<uint64_t>{1});
  CHECK(p.waiting_ids() == std::vector<uint64_t>{2, 3});
  std::vector<uint64_t> rel;
  p.apply(s1, answer(s1), &rel);
  CHECK(p.kv_blocks_used() == 3);
  // 1 finishes after its 4 tokens; only then is 2 admitted.
  for (int i = 0; i < 3; ++i) {
    StepPlan s = p.plan();
    CHECK(picture(s) == "1:" + std::to_string(9 + i) + "+1s");
    p.apply(s, answer(s), &rel);
  }
  CHECK(rel == std::vector<uint64_t>{1});
  StepPlan s5 = p.plan();
  CHECK(picture(s5) == "2:0+9s 3:0+2s");  // 2 (3 blocks) + 3 (1 block + 1 headroom) fit in 6
}

TEST_CASE("a request that can never fit is rejected, not queued forever", "[scheduler][policy]") {
  BatchPolicy p(limits(64, 2));  // 8 tokens of KV in all
  p.add(1, req(9, 4));           // its prompt alone needs 3 blocks
  p.add(2, req(3, 1));
  std::vector<SequenceUpdate> rejected;
  StepPlan s = p.plan(&rejected);
  REQUIRE(rejected.size() == 1);
  CHECK(rejected[0].seq_id == 1);
  CHECK(rejected[0].reason == FinishReason::error);
  CHECK(picture(s) == "2:0+3s");
}

TEST_CASE("a sequence that fills the whole KV cache ends with length, not a wait forever", "[scheduler][policy]") {
  // 2 blocks of 4 tokens: a 3-token prompt can grow to 8 positions, never a 9th.
  BatchPolicy p(limits(64, 2));
  p.add(1, req(3, 50));
  int token = 500;
  std::vector<int32_t> seen;
  SequenceUpdate last;
  for (int it = 0; it < 20 && p.running() + p.waiting() > 0; ++it) {
    StepPlan plan = p.plan();
    REQUIRE_FALSE(plan.empty());  // never a step with nothing in it while the sequence is alive
    CHECK(plan.release.empty());  // and never preempted
    for (const auto& u : p.apply(plan, answer(plan, token++), nullptr)) {
      for (const auto& t : u.tokens) seen.push_back(t.token);
      if (u.finished) last = u;
    }
  }
  CHECK(p.running() + p.waiting() == 0);
  CHECK(last.seq_id == 1);
  CHECK(last.reason == FinishReason::length);
  CHECK(seen.size() == 6);  // the context: 3 prompt + 6 generated = 9 tokens, the 9th never written
  CHECK(p.preemptions() == 0);
}

TEST_CASE("a resumed sequence longer than this worker's cache ends with length; a long prompt is an error",
          "[scheduler][policy]") {
  BatchPolicy p(limits(64, 2));  // 8 tokens of KV
  SequenceState moved{7, req(4, 20), {600, 601, 602, 603, 604}, {}};  // 9 tokens: ran on a larger worker
  p.add_resumed(std::move(moved), true);
  p.add(8, req(9, 2));
  std::vector<SequenceUpdate> rejected;
  p.plan(&rejected);
  REQUIRE(rejected.size() == 2);
  for (const auto& u : rejected) {
    CHECK(u.finished);
    if (u.seq_id == 7) CHECK((u.reason == FinishReason::length && u.error.empty()));
    if (u.seq_id == 8) CHECK((u.reason == FinishReason::error && !u.error.empty()));
  }
}

TEST_CASE("a sequence whose sampling the worker would refuse ends alone; its step runs for the others",
          "[scheduler][policy]") {
  BatchPolicy p(limits(64, 16));
  p.add(1, req(3, 4));
  SequenceRequest bad = req(3, 4);
  bad.sampling.repetition_penalty = 0.0f;  // what a tiny value narrowed to a float becomes
  p.add(2, std::move(bad));
  p.add(3, req(3, 4));
  std::vector<SequenceUpdate> rejected;
  StepPlan s = p.plan(&rejected);
  CHECK(picture(s) == "1:0+3s 3:0+3s");
  REQUIRE(rejected.size() == 1);
  CHECK(rejected[0].seq_id == 2);
  CHECK(rejected[0].reason == FinishReason::error);
  CHECK(rejected[0].error.find("repetition_penalty") != std::string::npos);
  for (const auto& c : s.chunks) CHECK(moe::protocol::sampling_problem(c.sampling).empty());
  CHECK(p.running() == 2);
  CHECK(p.waiting() == 0);
}

TEST_CASE("a prompt that fills the whole cache runs and gives one token; fits() says where a sequence may go",
          "[scheduler][policy]") {
  BatchPolicy p(limits(64, 2));  // 8 tokens of KV
  p.add(1, req(8, 5));
  std::vector<SequenceUpdate> rejected;
  StepPlan s = p.plan(&rejected);
  CHECK(rejected.empty());
  CHECK(picture(s) == "1:0+8s");
  auto u = p.apply(s, answer(s), nullptr);
  REQUIRE(u.size() == 1);
  CHECK(u[0].tokens.size() == 1);
  CHECK(u[0].finished);
  CHECK(u[0].reason == FinishReason::length);
  // A sequence of 8 tokens fits (prompt and generated alike), one of 9 does not.
  CHECK(p.fits({1, req(8, 5), {}, {}}));
  CHECK(p.fits({2, req(5, 5), {7, 7, 7}, {}}));
  CHECK_FALSE(p.fits({3, req(5, 5), {7, 7, 7, 7}, {}}));
  CHECK_FALSE(p.fits({4, req(9, 5), {}, {}}));
}

TEST_CASE("out of KV mid-decode preempts the youngest; recompute never repeats tokens", "[scheduler][policy]") {
  // 4 blocks of 4 tokens. Two sequences of 4-token prompts fit (1 block each + headroom);
  // they grow until the cache runs out.
  BatchPolicy p(limits(64, 4));
  p.add(1, req(4, 8, 10));
  p.add(2, req(4, 8, 20));
  std::vector<std::string> pics;
  std::vector<std::vector<uint64_t>> releases;
  std::map<uint64_t, std::vector<int32_t>> seen;  // tokens as an observer gets them
  int token = 500;
  for (int it = 0; it < 40; ++it) {
    StepPlan plan = p.plan();
    if (plan.empty()) break;
    pics.push_back(picture(plan));
    releases.push_back(plan.release);
    std::vector<ChunkResult> res;
    for (const auto& c : plan.chunks) {
      ChunkResult r;
      r.seq_id = c.seq_id;
      r.sampled = c.sample;
      r.token.token = c.sample ? token++ : 0;
      res.push_back(r);
    }
    std::vector<uint64_t> rel;
    for (const auto& u : p.apply(plan, res, &rel))
      for (const auto& t : u.tokens) seen[u.seq_id].push_back(t.token);
  }
  const std::vector<std::string> expected = {
      "1:0+4s 2:0+4s",          // both prompts: 2 blocks
      "1:4+1s 2:4+1s",          // positions 4: a second block each (4 used)
      "1:5+1s 2:5+1s", "1:6+1s 2:6+1s", "1:7+1s 2:7+1s",
      "1:8+1s",                 // position 8 needs a 3rd block each: 2 (youngest) is preempted
      "1:9+1s", "1:10+1s",      // 1 ends with its 8th token
      "2:0+9s",                 // 2 recomputes prompt + its 5 tokens, samples its 6th
      "2:9+1s", "2:10+1s",
  };
  CHECK(pics == expected);
  CHECK(releases[5] == std::vector<uint64_t>{2});
  CHECK(p.preemptions() == 1);
  // Every sequence got exactly 8 tokens, all distinct (never one twice).
  REQUIRE(seen[1].size() == 8);
  REQUIRE(seen[2].size() == 8);
  std::set<int32_t> all(seen[1].begin(), seen[1].end());
  all.insert(seen[2].begin(), seen[2].end());
  CHECK(all.size() == 16);
}

TEST_CASE("cancel frees a sequence at once and lets the next one in", "[scheduler][policy]") {
  BatchPolicy p(limits(64, 3));
  p.add(1, req(8, 100));  // 2 blocks, +1 for decode: the cache is full
  p.add(2, req(3, 2));
  StepPlan s1 = p.plan();
  CHECK(picture(s1) == "1:0+8s");
  std::vector<uint64_t> rel;
  p.apply(s1, answer(s1), &rel);
  CHECK(p.waiting_ids() == std::vector<uint64_t>{2});
  CHECK(p.cancel(1));       // held KV on the worker: the caller sends a release
  CHECK_FALSE(p.cancel(1));  // already gone
  StepPlan s2 = p.plan();
  CHECK(picture(s2) == "2:0+3s");
  // A result arriving for a cancelled sequence is ignored.
  CHECK(p.cancel(2));
  CHECK(p.apply(s2, answer(s2), &rel).empty());
  CHECK(p.running() == 0);
}

TEST_CASE("EOS stops a sequence after reporting the token; errors finish only their sequence", "[scheduler][policy]") {
  BatchPolicy p(limits(64, 100));
  auto r1 = req(3, 10);
  r1.stop_ids = {101};  // answer() gives sequence 1 token 101
  p.add(1, r1);
  p.add(2, req(3, 10));
  p.add(3, req(3, 10));
  StepPlan s = p.plan();
  auto res = answer(s);
  res[2].ok = false;
  res[2].error = "out of range";
  std::vector<uint64_t> rel;
  auto ups = p.apply(s, res, &rel);
  REQUIRE(ups.size() == 3);
  CHECK(ups[0].finished);
  CHECK(ups[0].reason == FinishReason::stop);
  CHECK(ups[0].tokens.size() == 1);
  CHECK_FALSE(ups[1].finished);
  CHECK(ups[2].reason == FinishReason::error);
  CHECK(ups[2].error == "out of range");
  CHECK(rel == std::vector<uint64_t>{1, 3});
  CHECK(p.running_ids() == std::vector<uint64_t>{2});
}

TEST_CASE("a lost worker puts every running sequence back in order, resuming after its tokens", "[scheduler][policy]") {
  BatchPolicy p(limits(64, 100));
  p.add(1, req(3, 5));
  p.add(2, req(2, 5));
  p.add(3, req(2, 5));
  std::vector<uint64_t> rel;
  for (int i = 0; i < 2; ++i) {
    StepPlan s = p.plan();
    p.apply(s, answer(s), &rel);
  }
  p.cancel(3);
  p.worker_lost();
  CHECK(p.waiting_ids() == std::vector<uint64_t>{1, 2});
  CHECK(p.kv_blocks_used() == 0);
  StepPlan s = p.plan();
  // prompt + the 2 tokens already reported, sampling the 3rd.
  CHECK(picture(s) == "1:0+5s 2:0+4s");
  CHECK(s.chunks[0].tokens == std::vector<int32_t>{1, 2, 3, 101, 101});
  auto ups = p.apply(s, answer(s), &rel);
  REQUIRE(ups.size() == 2);
  CHECK(ups[0].tokens.size() == 1);
  CHECK(p.generated(1)->size() == 3);
}

TEST_CASE("admission is round-robin across requests: many choices do not hold back a later request",
          "[scheduler][policy][admission]") {
  // One prompt's worth of budget a step, and sequences that end at their
  // first token: exactly one admission per step.
  BatchPolicy p(limits(4, 1000));
  auto in_group = [](uint64_t group) {
    SequenceRequest r = req(4, 1);
    r.group = group;
    return r;
  };
  for (uint64_t id = 1; id <= 6; ++id) p.add(id, in_group(7));  // a request of six choices
  p.add(10, in_group(8));                                        // then one of one
  p.add(11, in_group(9));                                        // then another
  std::vector<uint64_t> order;
  for (int step = 0; step < 8; ++step) {
    StepPlan s = p.plan();
    for (const auto& c : s.chunks)
      if (c.start_pos == 0) order.push_back(c.seq_id);  // admitted this step
    std::vector<uint64_t> rel;
    p.apply(s, answer(s), &rel);
  }
  // The first of the six, then each later request in turn, then the rest.
  CHECK(order == std::vector<uint64_t>{1, 10, 11, 2, 3, 4, 5, 6});
}

TEST_CASE("sequences a lost worker held go before the round-robin", "[scheduler][policy][admission]") {
  BatchPolicy p(limits(7, 1000));  // one 7-token prompt a step
  auto in_group = [](uint64_t group) {
    SequenceRequest r = req(7, 1);
    r.group = group;
    return r;
  };
  p.add(1, in_group(1));
  p.add(2, in_group(2));
  CHECK(picture(p.plan()) == "1:0+7s");  // 1 admitted (its group now the most recent)
  p.worker_lost();                       // and put back at the front
  p.add(3, in_group(3));
  std::vector<uint64_t> order;
  for (int step = 0; step < 3; ++step) {
    StepPlan s = p.plan();
    for (const auto& c : s.chunks)
      if (c.start_pos == 0) order.push_back(c.seq_id);
    std::vector<uint64_t> rel;
    p.apply(s, answer(s), &rel);
  }
  // A plain round-robin would start with 2 and 3 (never admitted).
  CHECK(order == std::vector<uint64_t>{1, 2, 3});
}

TEST_CASE("each sampled chunk carries the token controls: biases, penalised history, stop ids banned before min_tokens",
          "[scheduler][policy][sampling]") {
  using moe::TokenAdjust;
  const float ban = -std::numeric_limits<float>::infinity();
  BatchPolicy p(limits(64, 100));
  SequenceRequest r = req(3, 5, 10);  // prompt 10 11 12
  r.prompt.push_back(11);             // 10 11 12 11
  r.sampling.frequency_penalty = 0.5f;
  r.logit_bias = {{3, 1.5f}, {11, -2.0f}};
  r.stop_ids = {0, 7};
  r.min_tokens = 2;
  p.add(1, r);
  SequenceRequest plain = req(2, 3, 50);  // no controls: an empty list
  p.add(2, plain);
  // The worker answers 1 with 11, then 13, then 11 ...; 2 with 60 each time.
  const int32_t answers[] = {11, 13, 11, 7};
  std::vector<std::vector<TokenAdjust>> lists;
  for (int s = 0; s < 4; ++s) {
    StepPlan plan = p.plan();
    std::vector<ChunkResult> res;
    for (const PlannedChunk& c : plan.chunks) {
      if (c.seq_id == 1 && c.sample) lists.push_back(c.sampling.adjust);
      if (c.seq_id == 2 && c.sample) CHECK(c.sampling.adjust.empty());
      ChunkResult cr;
      cr.seq_id = c.seq_id;
      cr.sampled = c.sample;
      cr.token.token = c.seq_id == 1 ? answers[s] : 60;
      res.push_back(cr);
    }
    std::vector<uint64_t> release;
    p.apply(plan, res, &release);
  }
  REQUIRE(lists.size() == 4);
  // Before any output: prompt tokens flagged, biases, stop ids 0 and 7 banned (0 of 2 generated).
  CHECK(lists[0] == std::vector<TokenAdjust>{{0, ban, 0, 0}, {3, 1.5f, 0, 0}, {7, ban, 0, 0}, {10, 0, 0, 1},
                                             {11, -2.0f, 0, 1}, {12, 0, 0, 1}});
  // After "11": its count, still banned (1 of 2).
  CHECK(lists[1] == std::vector<TokenAdjust>{{0, ban, 0, 0}, {3, 1.5f, 0, 0}, {7, ban, 0, 0}, {10, 0, 0, 1},
                                             {11, -2.0f, 1, 1}, {12, 0, 0, 1}});
  // After "11 13": min_tokens reached, the bans are gone; 13 counted.
  CHECK(lists[2] == std::vector<TokenAdjust>{{3, 1.5f, 0, 0}, {10, 0, 0, 1}, {11, -2.0f, 1, 1}, {12, 0, 0, 1},
                                             {13, 0, 1, 0}});
  CHECK(lists[3] == std::vector<TokenAdjust>{{3, 1.5f, 0, 0}, {10, 0, 0, 1}, {11, -2.0f, 2, 1}, {12, 0, 0, 1},
                                             {13, 0, 1, 0}});

  // A sequence moved to another worker (or preempted) rebuilds the same list
  // from its prompt and generated tokens.
  TokenControls moved(r, std::vector<int32_t>{11, 13, 11});
  CHECK(moved.next(r, 3) == lists[3]);
  TokenControls early(r, std::vector<int32_t>{11});
  CHECK(early.next(r, 1) == lists[1]);
  // Without a penalty only biases and bans travel.
  SequenceRequest biased = r;
  biased.sampling.frequency_penalty = 0;
  CHECK(TokenControls(biased, std::vector<int32_t>{11, 13}).next(biased, 2) ==
        std::vector<TokenAdjust>{{3, 1.5f, 0, 0}, {11, -2.0f, 0, 0}});
}
