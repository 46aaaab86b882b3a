// Codec cost of a typical decode step, printed for the record. Hidden from
// the default run: `moe_protocol_tests "[bench]"`.
#include <catch2/catch.hpp>
#include <chrono>
#include <cstdio>

#include "protocol/messages.h"

using namespace moe::protocol;

TEST_CASE("codec cost of a 64-sequence decode step and its reply", "[.][bench]") {
  StepRequest req;
  StepReply reply;
  for (uint64_t i = 1; i <= 64; ++i) {
    req.sequences.push_back(
        {i, {static_cast<int32_t>(i)}, 500, true, {0.7f, 0.9f, 40, i, true, 5}});
    StepResult r;
    r.seq_id = i;
    r.sampled = true;
    r.top.assign(5, {3, -1.5f});
    r.expert_usage.assign(24 * 60, 0);  // Qwen1.5-MoE-A2.7B: 24 MoE layers x 60 experts
    reply.results.push_back(std::move(r));
  }
  const int iters = 2000;
  size_t bytes = 0;
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < iters; ++i) {
    auto f = make_frame(static_cast<uint64_t>(i), req).value();
    FrameDecoder d;
    d.feed(f);
    auto back = decode_message(d.next().frame);
    REQUIRE(back.ok());
    bytes = f.size();
  }
  const auto t1 = std::chrono::steady_clock::now();
  size_t reply_bytes = 0;
  for (int i = 0; i < iters; ++i) {
    auto f = make_frame(static_cast<uint64_t>(i), reply).value();
    FrameDecoder d;
    d.feed(f);
    auto back = decode_message(d.next().frame);
    REQUIRE(back.ok());
    reply_bytes = f.size();
  }
  const auto t2 = std::chrono::steady_clock::now();
  const double req_us = std::chrono::duration<double, std::micro>(t1 - t0).count() / iters;
  const double rep_us = std::chrono::duration<double, std::micro>(t2 - t1).count() / iters;
  std::printf("step request: %zu bytes, encode+frame+decode %.1f us\n", bytes, req_us);
  std::printf("step reply:   %zu bytes, encode+frame+decode %.1f us\n", reply_bytes, rep_us);
}
