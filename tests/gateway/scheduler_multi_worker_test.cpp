// Several workers at once, over real moe-worker children on a fixture model:
// sequences are spread over the workers and give the tokens of a one-worker
// run; a worker killed mid-generation costs no token; and with a prediction
// a request goes to the worker whose resident experts match it; a worker of
// another vocabulary is refused.
#include <uv.h>

#include <catch2/catch.hpp>
#include <csignal>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "gateway/predict/expert_prediction.h"
#include "gateway/sched/scheduler_continuous.h"
#include "gateway/sched/worker_supervisor.h"
#include "model/model_config.h"
#include "model/safetensors.h"
#include "tests/gateway/scheduler_test_parts.h"

using namespace moe::gw;
using namespace moe::gw::test;

namespace {

// Two supervised workers, "a" and "b" (their socket stems), one scheduler.
struct TwoWorkers {
  uv_loop_t loop{};
  std::vector<std::unique_ptr<WorkerSupervisor>> sups;
  std::unique_ptr<ContinuousScheduler> sched;

  // extra: both workers' options; extra_b (when given): b's instead.
  explicit TwoWorkers(ContinuousSchedulerOptions o, std::vector<std::string> extra = {},
                      std::vector<std::string> extra_b = {}) {
    uv_loop_init(&loop);
    std::vector<std::string> sockets;
    for (const char* name : {"a.sock", "b.sock"}) {
      SupervisorOptions so;
      so.worker_bin = MOE_WORKER_BIN;
      so.model_path = scheduler_fixture();
      so.extra_args = {"--threads", "1", "--backend", "cpu"};
      const auto& mine = name[0] == 'b' && !extra_b.empty() ? extra_b : extra;
      so.extra_args.insert(so.extra_args.end(), mine.begin(), mine.end());
      so.socket_name = name;
      auto s = WorkerSupervisor::start(&loop, so);
      REQUIRE(s.ok());
      sockets.push_back(s.value()->socket_path());
      sups.push_back(std::move(s.value()));
    }
    sched = std::make_unique<ContinuousScheduler>(&loop, sockets, std::move(o));
    run_until([&] { return both_ready(); });
    REQUIRE(both_ready());
  }
  ~TwoWorkers() {
    sched.reset();
    sups.clear();
    for (int i = 0; i < 10; ++i) uv_run(&loop, UV_RUN_NOWAIT);
    (void)uv_loop_close(&loop);
  }
  bool both_ready() const { return sched->worker_ready(0) && sched->worker_ready(1); }
  template <typename F, typename T = void (*)()>
  void run_until(F done, T tick = [] {}) {
    run_loop_until(&loop, done, tick);
  }
};

}  // namespace

TEST_CASE("two workers serve at once: tokens as on one, and a kill -9 of one loses none",
          "[scheduler][worker][multi]") {
  ContinuousSchedulerOptions o;
  o.max_step_tokens = 32;
  TwoWorkers rig(o);
  auto base = fixture_requests(16);
  REQUIRE(base.size() >= 2);
  std::vector<SequenceRequest> reqs;
  for (int i = 0; i < 8; ++i) reqs.push_back(base[size_t(i) % base.size()]);

  // One at a time: both workers idle, so each goes to the first.
  std::vector<std::vector<int32_t>> alone;
  for (const auto& r : reqs) {
    Collector c;
    rig.sched->submit(r, &c);
    rig.run_until([&] { return c.done; });
    REQUIRE(c.done);
    alone.push_back(c.tokens);
  }
  CHECK(rig.sched->sequences_assigned(0) == reqs.size());
  CHECK(rig.sched->sequences_assigned(1) == 0);

  // Together: spread by load over both, same tokens.
  std::vector<Collector> together(reqs.size());
  for (size_t i = 0; i < reqs.size(); ++i) rig.sched->submit(reqs[i], &together[i]);
  rig.run_until([&] { return all_done(together); });
  REQUIRE(all_done(together));
  for (size_t i = 0; i < reqs.size(); ++i) {
    INFO("sequence " << i);
    CHECK(together[i].tokens == alone[i]);
  }
  CHECK(rig.sched->sequences_assigned(1) >= 3);
  CHECK(rig.sched->sequences_assigned(0) >= reqs.size() + 3);
  CHECK(rig.sched->steps_sent(1) > 0);

  // kill -9 of worker b mid-generation: its sequences finish elsewhere, with
  // the tokens of the undisturbed run, none repeated (Collector checks).
  std::vector<Collector> run(reqs.size());
  for (size_t i = 0; i < reqs.size(); ++i) rig.sched->submit(reqs[i], &run[i]);
  bool killed = false;
  rig.run_until([&] { return all_done(run); },
                [&] {
                  size_t n = 0;
                  for (auto& c : run) n += c.tokens.size();
                  if (!killed && n >= 2 * reqs.size()) {
                    REQUIRE(rig.sups[1]->child_pid() > 0);
                    ::kill(rig.sups[1]->child_pid(), SIGKILL);
                    killed = true;
                  }
                });
  REQUIRE(killed);
  REQUIRE(all_done(run));
  for (size_t i = 0; i < reqs.size(); ++i) {
    INFO("sequence " << i);
    CHECK(run[i].reason == FinishReason::length);
    CHECK(run[i].tokens == alone[i]);
  }
  const SchedulerStats st = rig.sched->stats();
  CHECK(st.running == 0);
  CHECK(st.waiting == 0);
}

TEST_CASE("a request goes to the worker whose resident experts match its prediction",
          "[scheduler][worker][multi][prediction]") {
  PredictorOptions po;
  po.experts_per_layer = 2;
  auto pred = PromptExpertPredictor::open(scheduler_fixture(), po);
  REQUIRE(pred.ok());
  PromptExpertPredictor& p = *pred.value();
  REQUIRE(p.n_layers() == 2);
  REQUIRE(p.n_experts() == 16);
  auto reqs = fixture_requests(4);
  const uint32_t bp = p.bucket_of(reqs[0].prompt), bq = p.bucket_of(reqs[1].prompt);
  REQUIRE(bp != bq);
  // Prompt 0's kind uses experts 0 and 1, prompt 1's kind experts 8 and 9.
  auto usage = [](std::vector<int> experts) {
    std::vector<float> u(2 * 16, 0.0f);
    for (int l = 0; l < 2; ++l)
      for (int e : experts) u[size_t(l * 16 + e)] = 5;
    return u;
  };
  for (int i = 0; i < 3; ++i) {
    p.learn(bp, usage({0, 1}));
    p.learn(bq, usage({8, 9}));
  }
  ContinuousSchedulerOptions o;
  o.predictor = &p;
  o.report_expert_usage = true;
  // Worker a holds prompt 1's experts, worker b prompt 0's.
  o.resident_sets = [] {
    return std::map<std::string, std::string>{{"a", "0:8 0:9 1:8 1:9"}, {"b", "0:0 0:1 1:0 1:1"}};
  };
  TwoWorkers rig(o);
  Collector c0;
  rig.sched->submit(reqs[0], &c0);
  rig.run_until([&] { return c0.done; });
  REQUIRE(c0.done);
  CHECK(rig.sched->sequences_assigned(0) == 0);
  CHECK(rig.sched->sequences_assigned(1) == 1);
  Collector c1;
  rig.sched->submit(reqs[1], &c1);
  rig.run_until([&] { return c1.done; });
  REQUIRE(c1.done);
  CHECK(rig.sched->sequences_assigned(0) == 1);
  CHECK(rig.sched->sequences_assigned(1) == 1);
  // Both predictions were checked against the usage the workers reported,
  // and each prefill was preceded by warm hints.
  const SchedulerStats st = rig.sched->stats();
  CHECK(st.prediction_requests == 2);
  CHECK(st.predicted_experts == 8);
  CHECK(st.warm_hints_sent == 2);
}

TEST_CASE("an idle worker takes over half the queue of a busy one", "[scheduler][worker][multi]") {
  PredictorOptions po;
  po.experts_per_layer = 2;
  auto pred = PromptExpertPredictor::open(scheduler_fixture(), po);
  REQUIRE(pred.ok());
  PromptExpertPredictor& p = *pred.value();
  auto reqs = fixture_requests(8);
  std::vector<float> u(2 * 16, 0.0f);
  for (int l = 0; l < 2; ++l) u[size_t(l * 16)] = u[size_t(l * 16 + 1)] = 5;
  p.learn(p.bucket_of(reqs[0].prompt), u);
  ContinuousSchedulerOptions o;
  o.predictor = &p;
  o.report_expert_usage = true;
  o.choice.load_weight = 0;  // the match alone decides: every copy goes to worker a
  o.resident_sets = [] {
    return std::map<std::string, std::string>{{"a", "0:0 0:1 1:0 1:1"}, {"b", ""}};
  };
  // Two KV blocks of 16 tokens: one sequence at a time per worker.
  TwoWorkers rig(o, {"--kv-blocks", "2"});
  std::vector<Collector> run(6);
  for (auto& c : run) rig.sched->submit(reqs[0], &c);
  rig.run_until([&] { return all_done(run); });
  REQUIRE(all_done(run));
  CHECK(rig.sched->sequences_assigned(0) == 6);
  CHECK(rig.sched->sequences_assigned(1) == 0);
  CHECK(rig.sched->sequences_taken_over(1) >= 3);
  CHECK(rig.sched->steps_sent(1) > 0);
  for (const auto& c : run) {
    CHECK(c.reason == FinishReason::length);
    CHECK(c.tokens == run[0].tokens);
  }
}

TEST_CASE("a worker too small for a sequence never takes it, idle or not", "[scheduler][worker][multi]") {
  // a: 8 blocks of 16 tokens; b: 2 (32 tokens), too few for any prompt plus
  // 40 tokens. Every sequence runs on a, whole, whatever b's idleness says.
  ContinuousSchedulerOptions o;
  TwoWorkers rig(o, {"--kv-blocks", "8"}, {"--kv-blocks", "2"});
  auto reqs = fixture_requests(40);
  REQUIRE(int(reqs[0].prompt.size()) + 40 > 32);
  REQUIRE(int(reqs[0].prompt.size()) + 40 <= 128);
  Collector alone;
  rig.sched->submit(reqs[0], &alone);
  rig.run_until([&] { return alone.done; });
  REQUIRE(alone.done);
  CHECK(alone.reason == FinishReason::length);
  CHECK(alone.tokens.size() == 40);
  std::vector<Collector> run(5);
  for (auto& c : run) rig.sched->submit(reqs[0], &c);
  rig.run_until([&] { return all_done(run); });
  REQUIRE(all_done(run));
  for (const auto& c : run) {
    CHECK(c.reason == FinishReason::length);
    CHECK(c.tokens == alone.tokens);
  }
  CHECK(rig.sched->sequences_assigned(1) == 0);
  CHECK(rig.sched->sequences_taken_over(1) == 0);
  // A short one that b holds whole may still go there.
  Collector small;
  SequenceRequest s = reqs[0];
  s.max_new_tokens = 2;
  std::vector<Collector> busy(3);
  for (auto& c : busy) rig.sched->submit(reqs[0], &c);
  rig.sched->submit(s, &small);
  rig.run_until([&] { return all_done(busy) && small.done; });
  CHECK(small.tokens.size() == 2);
}

TEST_CASE("check_vocabulary: the same size and EOS ids pass, in any order; anything else names both",
          "[scheduler][vocabulary]") {
  moe::protocol::Hello h;
  h.model_id = "small";
  h.vocab_size = 1027;
  h.eos_ids = {1026, 7};
  WorkerVocabulary v{"big", 1027, {7, 1026}};
  CHECK(check_vocabulary(h, v).ok());
  CHECK(check_vocabulary(h, WorkerVocabulary{}).ok());  // no expectation: no check
  h.vocab_size = 4099;
  auto st = check_vocabulary(h, v);
  REQUIRE_FALSE(st.ok());
  CHECK_THAT(st.error(), Catch::Contains("'small' has a vocabulary of 4099 token ids (EOS 7 1026)") &&
                             Catch::Contains("'big' one of 1027 (EOS 7 1026)") && Catch::Contains("tokenizer"));
  h.vocab_size = 1027;
  h.eos_ids = {1026};
  CHECK_FALSE(check_vocabulary(h, v).ok());
}

TEST_CASE("a worker whose model has another vocabulary than the gateway's is refused, never ready",
          "[scheduler][worker][vocabulary]") {
  auto desc = moe::load_model_desc(scheduler_fixture());
  REQUIRE(desc.ok());
  for (bool same : {false, true}) {
    uv_loop_t loop{};
    uv_loop_init(&loop);
    SupervisorOptions so;
    so.worker_bin = MOE_WORKER_BIN;
    so.model_path = scheduler_fixture();
    so.extra_args = {"--threads", "1", "--backend", "cpu"};
    auto s = WorkerSupervisor::start(&loop, so);
    REQUIRE(s.ok());
    ContinuousSchedulerOptions o;
    // The demo model's vocabulary (4099 ids, EOS 4096), or the fixture's own.
    o.link.vocabulary = same ? WorkerVocabulary{"qwen3_moe", uint32_t(desc->vocab_size), desc->eos_token_ids}
                             : WorkerVocabulary{"demo-moe", 4099, {4096}};
    auto sched = std::make_unique<ContinuousScheduler>(&loop, std::vector<std::string>{s.value()->socket_path()}, o);
    run_loop_until(&loop, [&] { return sched->worker_ready(0) || !sched->worker_refused(0).empty(); });
    CHECK(sched->worker_ready(0) == same);
    CHECK(sched->worker_refused(0).empty() == same);
    if (!same) CHECK_THAT(sched->worker_refused(0), Catch::Contains("'demo-moe' one of 4099"));
    sched.reset();
    s.value().reset();
    for (int i = 0; i < 10; ++i) uv_run(&loop, UV_RUN_NOWAIT);
    (void)uv_loop_close(&loop);
  }
}
