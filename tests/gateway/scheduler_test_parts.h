#pragma once
// What the scheduler tests over real moe-worker children share: the fixture
// they serve, its reference prompts as requests, an observer that collects
// a sequence's tokens, and running a libuv loop until a condition holds.

#include <uv.h>

#include <catch2/catch.hpp>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "gateway/sched/scheduler.h"
#include "model/safetensors.h"
#include "tests/reference_tensors.h"

namespace moe::gw::test {

inline std::string scheduler_fixture() { return std::string(MOE_TEST_DATA) + "/fixtures/qwen3_moe"; }

// Collects one sequence's tokens; a token after the end fails the test.
struct Collector : SequenceObserver {
  std::vector<int32_t> tokens;
  bool done = false;
  FinishReason reason = FinishReason::error;
  std::string error;
  std::function<void(size_t)> after_token;  // called with the count so far
  void on_token(const TokenEvent& ev) override {
    REQUIRE_FALSE(done);
    tokens.push_back(ev.token);
    if (after_token) after_token(tokens.size());
  }
  void on_finished(FinishReason r, const std::string& e) override {
    done = true;
    reason = r;
    error = e;
  }
};

inline bool all_done(const std::vector<Collector>& cs) {
  for (const auto& c : cs)
    if (!c.done) return false;
  return true;
}

// The fixture's reference prompts as greedy requests of max_new tokens.
inline std::vector<SequenceRequest> fixture_requests(int max_new) {
  auto ref = moe::Checkpoint::open_file(scheduler_fixture() + "/reference.safetensors");
  REQUIRE(ref.ok());
  std::vector<SequenceRequest> out;
  for (int p = 0; ref->find("p" + std::to_string(p) + ".input_ids"); ++p) {
    SequenceRequest r;
    r.prompt = moe::test::ints(*ref->find("p" + std::to_string(p) + ".input_ids"));
    r.max_new_tokens = max_new;
    r.sampling.temperature = 0;
    out.push_back(r);
  }
  return out;
}

// Runs `loop` until `done()` or 60 s pass; `tick` runs every 2 ms.
template <typename F, typename T = void (*)()>
void run_loop_until(uv_loop_t* loop, F done, T tick = [] {}) {
  struct Ctx {
    F* done;
    T* tick;
    uint64_t deadline;
  } ctx{&done, &tick, uv_now(loop) + 60000};
  uv_timer_t t;
  uv_timer_init(loop, &t);
  t.data = &ctx;
  uv_timer_start(
      &t,
      [](uv_timer_t* h) {
        auto* c = static_cast<Ctx*>(h->data);
        (*c->tick)();
        if ((*c->done)() || uv_now(h->loop) > c->deadline) uv_stop(h->loop);
      },
      2, 2);
  uv_run(loop, UV_RUN_DEFAULT);
  uv_close(reinterpret_cast<uv_handle_t*>(&t), nullptr);
  uv_run(loop, UV_RUN_NOWAIT);
}

}  // namespace moe::gw::test
