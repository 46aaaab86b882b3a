// moe-gateway's command line.
#include <catch2/catch.hpp>

#include "gateway/gateway_options.h"

using moe::gw::parse_gateway_args;

TEST_CASE("options: every option parses, defaults otherwise", "[gateway][options]") {
  auto r = parse_gateway_args({"--model", "/m/demo-moe/", "--worker", "unix:/tmp/a.sock", "--worker=unix:/tmp/b.sock",
                               "--port", "9000", "--api-key", "k", "--max-body-bytes", "2048", "--redis",
                               "redis://127.0.0.1:6379", "--request-timeout-ms", "50"});
  REQUIRE(r.ok());
  const auto& o = r->options;
  CHECK(o.model_path == "/m/demo-moe/");
  CHECK(o.served_model_name == "demo-moe");
  CHECK(o.workers == std::vector<std::string>{"unix:/tmp/a.sock", "unix:/tmp/b.sock"});
  CHECK(o.host == "127.0.0.1");
  CHECK(o.port == 9000);
  CHECK(o.api_keys == std::vector<std::string>{"k"});
  CHECK(o.max_body_bytes == 2048);
  CHECK(o.redis_url == "redis://127.0.0.1:6379");
  CHECK(o.request_timeout_ms == 50);
  CHECK(o.keepalive_timeout_ms == 60000);
}

TEST_CASE("options: errors name the option", "[gateway][options]") {
  auto missing_model = parse_gateway_args({"--port", "1"});
  REQUIRE_FALSE(missing_model.ok());
  CHECK(missing_model.error().find("--model") != std::string::npos);
  auto bad_port = parse_gateway_args({"--model", "m", "--port", "70000"});
  REQUIRE_FALSE(bad_port.ok());
  CHECK(bad_port.error().find("--port") != std::string::npos);
  auto unknown = parse_gateway_args({"--model", "m", "--frobnicate", "1"});
  REQUIRE_FALSE(unknown.ok());
  CHECK(unknown.error().find("--frobnicate") != std::string::npos);
  auto bad_worker = parse_gateway_args({"--model", "m", "--worker", "tcp:1.2.3.4"});
  REQUIRE_FALSE(bad_worker.ok());
  auto no_value = parse_gateway_args({"--model"});
  REQUIRE_FALSE(no_value.ok());
}

TEST_CASE("options: --worker-wait-s, its default, 0 and its errors", "[gateway][options]") {
  auto d = parse_gateway_args({"--model", "m"});
  REQUIRE(d.ok());
  CHECK(d->options.worker_wait_s == 120);  // room for a large model's load (43 s for 61 GB)
  auto never = parse_gateway_args({"--model", "m", "--worker-wait-s", "0"});
  REQUIRE(never.ok());
  CHECK(never->options.worker_wait_s == 0);  // wait for ever
  auto r = parse_gateway_args({"--model", "m", "--worker-wait-s=2"});
  REQUIRE(r.ok());
  CHECK(r->options.worker_wait_s == 2);
  for (const char* bad : {"-1", "1.5", "86401", "soon"}) {
    auto e = parse_gateway_args({"--model", "m", "--worker-wait-s", bad});
    REQUIRE_FALSE(e.ok());
    CHECK(e.error().find("--worker-wait-s") != std::string::npos);
  }
}

TEST_CASE("options: --help and --version need no model", "[gateway][options]") {
  auto h = parse_gateway_args({"--help"});
  REQUIRE(h.ok());
  CHECK(h->help);
  auto v = parse_gateway_args({"--version"});
  REQUIRE(v.ok());
  CHECK(v->version);
}

TEST_CASE("options: expert prediction flags, their defaults and their errors", "[gateway][options]") {
  auto d = parse_gateway_args({"--model", "m"});
  REQUIRE(d.ok());
  CHECK_FALSE(d->options.predict);  // off by default: measured, neither paid (docs/expert-prediction.md)
  CHECK_FALSE(d->options.grouped_batching);
  CHECK(d->options.lsh_bits == 12);
  CHECK(d->options.lsh_seed == 1);
  CHECK(d->options.predict_half_life == 500);
  CHECK(d->options.predict_experts == 8);
  CHECK(d->options.grouping_max_skips == 4);
  auto r = parse_gateway_args({"--model", "m", "--predict", "on", "--grouped-batching=on", "--lsh-bits", "12",
                               "--lsh-seed", "18446744073709551615", "--predict-half-life", "50",
                               "--predict-experts", "4", "--grouping-max-skips", "0"});
  REQUIRE(r.ok());
  CHECK(r->options.predict);
  CHECK(r->options.grouped_batching);
  CHECK(r->options.lsh_bits == 12);
  CHECK(r->options.lsh_seed == 18446744073709551615ull);
  CHECK(r->options.predict_half_life == 50);
  CHECK(r->options.predict_experts == 4);
  CHECK(r->options.grouping_max_skips == 0);
  for (auto bad : {std::vector<std::string>{"--model", "m", "--predict", "yes"},
                   std::vector<std::string>{"--model", "m", "--lsh-bits", "0"},
                   std::vector<std::string>{"--model", "m", "--lsh-bits", "33"},
                   std::vector<std::string>{"--model", "m", "--predict-experts", "0"},
                   std::vector<std::string>{"--model", "m", "--predict-half-life", "0"}}) {
    auto e = parse_gateway_args(bad);
    REQUIRE_FALSE(e.ok());
    CHECK(e.error().find(bad[2]) != std::string::npos);
  }
  const std::string help = moe::gw::gateway_usage();
  for (const char* flag : {"--predict on|off", "--grouped-batching on|off", "--lsh-bits", "--lsh-seed",
                           "--predict-half-life", "--predict-experts", "--grouping-max-skips"})
    CHECK(help.find(flag) != std::string::npos);
}

TEST_CASE("options: --worker-arg goes to the gateway's own worker, never beside --worker", "[gateway][options]") {
  auto ok = parse_gateway_args({"--model", "m", "--worker-arg", "--vram-budget", "--worker-arg=10GiB"});
  REQUIRE(ok.ok());
  CHECK(ok->options.worker_args == std::vector<std::string>{"--vram-budget", "10GiB"});
  auto both = parse_gateway_args({"--model", "m", "--worker", "unix:/tmp/w.sock", "--worker-arg", "--threads"});
  REQUIRE_FALSE(both.ok());
  CHECK(both.error().find("--worker-arg") != std::string::npos);
  auto own = parse_gateway_args({"--model", "m", "--worker-arg", "--socket=/tmp/x"});
  REQUIRE_FALSE(own.ok());
  CHECK(own.error().find("--socket") != std::string::npos);
}
