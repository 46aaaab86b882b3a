// The scheduler end to end over a real moe-worker child (supervised) on a
// fixture model: batching does not change greedy tokens, and a worker killed
// mid-generation costs no token and repeats none.
#include <functional>
#include <catch2/catch.hpp>

#include <csignal>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include <uv.h>

#include "gateway/sched/scheduler_continuous.h"
#include "gateway/sched/worker_supervisor.h"
#include "model/safetensors.h"
#include "tests/gateway/scheduler_test_parts.h"

using namespace moe::gw;
using namespace moe::gw::test;

namespace {

struct Rig {
  uv_loop_t loop{};
  std::unique_ptr<ContinuousScheduler> sched;
  WorkerSupervisor* sup = nullptr;

  explicit Rig(int max_step_tokens) {
    uv_loop_init(&loop);
    SupervisorOptions so;
    so.worker_bin = MOE_WORKER_BIN;
    so.model_path = scheduler_fixture();
    so.extra_args = {"--threads", "1", "--backend", "cpu"};
    auto s = WorkerSupervisor::start(&loop, so);
    REQUIRE(s.ok());
    ContinuousSchedulerOptions o;
    o.max_step_tokens = max_step_tokens;
    sched = std::make_unique<ContinuousScheduler>(&loop, std::vector<std::string>{s.value()->socket_path()}, o);
    sup = s.value().get();
    sched->own_supervisor(std::move(s.value()));
    run_until([&] { return sched->ready(); });
    REQUIRE(sched->ready());
  }
  ~Rig() {
    sched.reset();
    for (int i = 0; i < 10; ++i) uv_run(&loop, UV_RUN_NOWAIT);
    (void)uv_loop_close(&loop);
  }
  // Runs the loop until `done()` or 60 s pass; `tick` runs every 2 ms.
  template <typename F, typename T = void (*)()>
  void run_until(F done, T tick = [] {}) {
    run_loop_until(&loop, done, tick);
  }
};

}  // namespace

TEST_CASE("sequences submitted together get the greedy tokens they get alone", "[scheduler][worker]") {
  Rig rig(16);  // small budget: prompts are prefilled in chunks next to decodes
  auto reqs = fixture_requests(12);
  REQUIRE(reqs.size() >= 4);
  std::vector<std::vector<int32_t>> alone;
  for (const auto& r : reqs) {
    Collector c;
    rig.sched->submit(r, &c);
    rig.run_until([&] { return c.done; });
    REQUIRE(c.done);
    CHECK(c.reason == FinishReason::length);
    CHECK(c.tokens.size() == 12);
    alone.push_back(c.tokens);
  }
  // The first prompt against the reference ids (its margins are wide at the start).
  auto ref = moe::Checkpoint::open_file(scheduler_fixture() + "/reference.safetensors");
  const auto want = moe::test::ints(*ref->find("p0.greedy_ids"));
  CHECK(std::vector<int32_t>(alone[0].begin(), alone[0].begin() + 4) ==
        std::vector<int32_t>(want.begin(), want.begin() + 4));

  std::vector<Collector> together(reqs.size());
  for (size_t i = 0; i < reqs.size(); ++i) rig.sched->submit(reqs[i], &together[i]);
  rig.run_until([&] {
    for (auto& c : together)
      if (!c.done) return false;
    return true;
  });
  for (size_t i = 0; i < reqs.size(); ++i) {
    INFO("prompt " << i);
    REQUIRE(together[i].done);
    CHECK(together[i].tokens == alone[i]);
  }
  const SchedulerStats st = rig.sched->stats();
  CHECK(st.running == 0);
  CHECK(st.waiting == 0);
  CHECK(st.kv_blocks_used == 0);

  // Cancel mid-stream, from inside the observer as the OpenAI layer does on a
  // stop string (a check from the loop could come after a fast worker had
  // already finished the sequence): no further observer call, and the others
  // finish.
  std::vector<Collector> more(2);
  uint64_t a = 0;
  more[0].after_token = [&](size_t n) {
    if (n == 3) rig.sched->cancel(a);
  };
  a = rig.sched->submit(reqs[0], &more[0]);
  rig.sched->submit(reqs[1], &more[1]);
  rig.run_until([&] { return more[1].done; });
  CHECK_FALSE(more[0].done);
  CHECK(more[0].tokens.size() == 3);
  CHECK(more[1].tokens == alone[1]);
}

TEST_CASE("kill -9 of the worker mid-generation: every sequence completes with the undisturbed tokens",
          "[scheduler][worker][failover]") {
  Rig rig(32);
  auto reqs = fixture_requests(16);
  std::vector<Collector> undisturbed(reqs.size());
  for (size_t i = 0; i < reqs.size(); ++i) rig.sched->submit(reqs[i], &undisturbed[i]);
  rig.run_until([&] { return all_done(undisturbed); });
  REQUIRE(all_done(undisturbed));

  std::vector<Collector> run(reqs.size());
  for (size_t i = 0; i < reqs.size(); ++i) rig.sched->submit(reqs[i], &run[i]);
  bool killed = false;
  rig.run_until([&] { return all_done(run); },
                [&] {
                  size_t n = 0;
                  for (auto& c : run) n += c.tokens.size();
                  if (!killed && n >= 2 * reqs.size()) {
                    REQUIRE(rig.sup->child_pid() > 0);
                    ::kill(rig.sup->child_pid(), SIGKILL);
                    killed = true;
                  }
                });
  REQUIRE(killed);
  CHECK(rig.sup->restarts() >= 1);
  for (size_t i = 0; i < reqs.size(); ++i) {
    INFO("prompt " << i);
    REQUIRE(run[i].done);
    CHECK(run[i].reason == FinishReason::length);
    CHECK(run[i].tokens == undisturbed[i].tokens);
  }
}
