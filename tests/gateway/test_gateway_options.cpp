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
  CHECK(o.api_key == "k");
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

TEST_CASE("options: --help and --version need no model", "[gateway][options]") {
  auto h = parse_gateway_args({"--help"});
  REQUIRE(h.ok());
  CHECK(h->help);
  auto v = parse_gateway_args({"--version"});
  REQUIRE(v.ok());
  CHECK(v->version);
}
