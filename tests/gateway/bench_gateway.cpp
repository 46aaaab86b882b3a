// Gateway overhead, measured (hidden: run with "[.bench]"). Sequential
// keep-alive requests over one connection, and the same from 4 client threads.
#include <catch2/catch.hpp>

#include <chrono>
#include <cstdio>
#include <thread>

#include "gateway_test_harness.h"

using namespace moe::gw;
using namespace moe::gw::test;

namespace {

double requests_per_second(int port, const std::string& request, int count, int threads) {
  auto t0 = std::chrono::steady_clock::now();
  std::vector<std::thread> pool;
  std::atomic<int> failures{0};
  for (int t = 0; t < threads; ++t) {
    pool.emplace_back([&] {
      TestClient c(port);
      for (int i = 0; i < count; ++i) {
        c.send(request);
        if (c.read_response().status != 200) ++failures;
      }
    });
  }
  for (auto& t : pool) t.join();
  double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  CHECK(failures == 0);
  return count * threads / s;
}

}  // namespace

TEST_CASE("bench: requests per second through the gateway", "[.bench]") {
  TestGateway gw;
  // One token per request, emitted on the scheduler double's next 1 ms tick.
  std::string body = R"({"model":"demo-moe","prompt":"hello","max_tokens":1})";
  std::string completion = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: " + std::to_string(body.size()) +
                           "\r\n\r\n" + body;
  std::string models = "GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n";
  for (int threads : {1, 4}) {
    std::printf("GET /v1/models, %d connection(s): %.0f req/s\n", threads,
                requests_per_second(gw.port(), models, 5000, threads));
    std::printf("POST /v1/completions (1 token, 1 ms tick), %d connection(s): %.0f req/s\n", threads,
                requests_per_second(gw.port(), completion, 300, threads));
  }
}
