// The HTTP layer over real TCP: keep-alive, pipelining, split delivery,
// limits, timeouts, slow readers and authentication.
#include <catch2/catch.hpp>

#include <thread>

#include <nlohmann/json.hpp>

#include "gateway_test_harness.h"

using namespace moe::gw;
using namespace moe::gw::test;
using nlohmann::json;

namespace {

const std::string kChatBody =
    R"({"model":"demo-moe","messages":[{"role":"user","content":"hi"}],"max_tokens":5})";

std::string post(const std::string& path, const std::string& body, const std::string& extra = "") {
  return "POST " + path + " HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n" + extra +
         "Content-Length: " + std::to_string(body.size()) + "\r\n\r\n" + body;
}

void check_error_shape(const ClientResponse& r, int status, const char* code) {
  INFO(r.body);
  CHECK(r.status == status);
  CHECK(r.headers.at("content-type") == "application/json");
  json j = json::parse(r.body);
  REQUIRE(j.contains("error"));
  CHECK(j["error"]["message"].is_string());
  CHECK(j["error"]["type"].is_string());
  CHECK(j["error"].contains("param"));
  CHECK(j["error"].contains("code"));
  if (code) CHECK(j["error"]["code"] == code);
}

}  // namespace

TEST_CASE("http: keep-alive serves several requests on one connection", "[gateway][http]") {
  TestGateway gw;
  TestClient c(gw.port());
  for (int i = 0; i < 3; ++i) {
    c.send("GET /v1/models HTTP/1.1\r\nHost: t\r\n\r\n");
    auto r = c.read_response();
    REQUIRE(r.ok);
    CHECK(r.status == 200);
    CHECK(r.headers["connection"] == "keep-alive");
  }
  c.send(post("/v1/chat/completions", kChatBody));
  auto r = c.read_response();
  REQUIRE(r.ok);
  CHECK(r.status == 200);
  CHECK(json::parse(r.body)["choices"][0]["message"]["content"] == "Hello");
}

TEST_CASE("http: pipelined requests are answered in order", "[gateway][http]") {
  TestGateway gw;
  TestClient c(gw.port());
  // A slow generation first, then a quick GET: the GET's answer must wait.
  c.send(post("/v1/chat/completions", kChatBody) + "GET /v1/models HTTP/1.1\r\nHost: t\r\n\r\n" +
         "GET /nope HTTP/1.1\r\nHost: t\r\n\r\n");
  auto r1 = c.read_response();
  auto r2 = c.read_response();
  auto r3 = c.read_response();
  REQUIRE(r1.ok);
  REQUIRE(r2.ok);
  REQUIRE(r3.ok);
  CHECK(json::parse(r1.body)["object"] == "chat.completion");
  CHECK(json::parse(r2.body)["object"] == "list");
  CHECK(r3.status == 404);
}

TEST_CASE("http: a request split into single bytes over the socket", "[gateway][http]") {
  TestGateway gw;
  TestClient c(gw.port());
  std::string req = post("/v1/chat/completions", kChatBody);
  for (char ch : req) {
    c.send(std::string(1, ch));
    if (&ch - req.data() < 40) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  auto r = c.read_response();
  REQUIRE(r.ok);
  CHECK(r.status == 200);
  CHECK(json::parse(r.body)["choices"][0]["message"]["content"] == "Hello");
}

TEST_CASE("http: header block too large is 431 and the connection closes", "[gateway][http]") {
  TestGateway gw;
  TestClient c(gw.port());
  c.send("GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Big: " + std::string(20000, 'a') + "\r\n\r\n");
  auto r = c.read_response();
  REQUIRE(r.ok);
  check_error_shape(r, 431, "request_header_too_large");
  CHECK(r.headers["connection"] == "close");
  CHECK(c.wait_closed());
}

TEST_CASE("http: body over --max-body-bytes is 413 in OpenAI's shape", "[gateway][http]") {
  HttpServerOptions o;
  o.limits.max_body_bytes = 1000;
  TestGateway gw(o);
  TestClient c(gw.port());
  std::string body = R"({"model":"demo-moe","prompt":")" + std::string(2000, 'x') + "\"}";
  c.send(post("/v1/completions", body));
  auto r = c.read_response();
  REQUIRE(r.ok);
  check_error_shape(r, 413, "request_too_large");
  CHECK(c.wait_closed());
  CHECK(gw.scheduler().submitted().empty());
}

TEST_CASE("http: Expect 100-continue gets 100 before the body", "[gateway][http]") {
  TestGateway gw;
  TestClient c(gw.port());
  c.send("POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nExpect: 100-continue\r\nContent-Length: " +
         std::to_string(kChatBody.size()) + "\r\n\r\n");
  auto interim = c.read_response();
  CHECK(interim.status == 100);
  c.send(kChatBody);
  auto r = c.read_response();
  REQUIRE(r.ok);
  CHECK(r.status == 200);
}

TEST_CASE("http: an HTTP/1.0 client's Expect gets no 100 Continue", "[gateway][http]") {
  TestGateway gw;
  TestClient c(gw.port());
  c.send("POST /v1/chat/completions HTTP/1.0\r\nExpect: 100-continue\r\nContent-Length: " +
         std::to_string(kChatBody.size()) + "\r\n\r\n" + kChatBody);
  auto r = c.read_response();  // the answer itself, not an interim one it cannot read
  REQUIRE(r.ok);
  CHECK(r.status == 200);
}

TEST_CASE("http: HEAD is a GET's head; HTTP/1.1 names its host; an absolute target is its path", "[gateway][http]") {
  TestGateway gw;
  TestClient c(gw.port());
  // Pipelined: the GET's answer follows the HEAD's head at once, so no body came between.
  c.send("HEAD /health HTTP/1.1\r\nHost: t\r\n\r\nGET /health HTTP/1.1\r\nHost: t\r\n\r\n");
  const std::string seen = c.read_until("\r\n\r\nHTTP/1.1 200 OK");
  REQUIRE(seen.find("\r\n\r\nHTTP/1.1 200 OK") != std::string::npos);
  CHECK(seen.rfind("HTTP/1.1 200 OK", 0) == 0);
  const size_t len_at = seen.find("Content-Length: ");
  REQUIRE(len_at != std::string::npos);
  const int head_length = std::stoi(seen.substr(len_at + 16));
  CHECK(head_length > 0);  // the length a GET's body has
  auto r = c.read_response(5000, /*head_only=*/true);
  CHECK(r.status == 200);
  auto get = c.read_response();
  REQUIRE(get.ok);
  CHECK(int(get.body.size()) == head_length);
  // HEAD where only POST is served: 405, and GET routes say they take HEAD too.
  c.send("HEAD /v1/chat/completions HTTP/1.1\r\nHost: t\r\n\r\n");
  c.send("GET /health HTTP/1.1\r\nHost: t\r\n\r\n");
  auto no = c.read_response(5000, /*head_only=*/true);
  CHECK(no.status == 405);
  CHECK(no.headers["allow"] == "POST");
  auto after = c.read_response();  // again the next answer follows the head at once
  CHECK(after.status == 200);
  CHECK(json::parse(after.body).is_object());
  auto post_health = http(gw.port(), "POST", "/health", "{}");
  check_error_shape(post_health, 405, "method_not_allowed");
  CHECK(post_health.headers["allow"] == "GET, HEAD");
  // No Host (or two) on HTTP/1.1: 400, and the connection closes.
  for (const char* head : {"GET /health HTTP/1.1\r\n\r\n", "GET /health HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n"}) {
    TestClient bad(gw.port());
    bad.send(head);
    auto e = bad.read_response();
    check_error_shape(e, 400, "bad_request");
    CHECK(bad.wait_closed());
  }
  // The absolute form a proxy sends is served as its path.
  TestClient abs(gw.port());
  abs.send("GET http://gateway.example:8000/v1/models HTTP/1.1\r\nHost: gateway.example:8000\r\n\r\n");
  auto models = abs.read_response();
  REQUIRE(models.ok);
  CHECK(models.status == 200);
  CHECK(json::parse(models.body)["object"] == "list");
}

TEST_CASE("http: bad request line, chunked body, HTTP/2 preface", "[gateway][http]") {
  TestGateway gw;
  {
    TestClient c(gw.port());
    c.send("HELLO\r\n\r\n");
    auto r = c.read_response();
    REQUIRE(r.ok);
    check_error_shape(r, 400, "bad_request");
    CHECK(c.wait_closed());
  }
  {
    TestClient c(gw.port());
    c.send("POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n");
    auto r = c.read_response();
    REQUIRE(r.ok);
    check_error_shape(r, 411, "length_required");
  }
  {
    TestClient c(gw.port());
    c.send("PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n");
    auto r = c.read_response();
    REQUIRE(r.ok);
    CHECK(r.status == 400);
  }
  // What the server does not take is the client's error, not an internal one.
  for (const auto& [req, status, code] :
       {std::tuple{std::string("GET /v1/models HTTP/3.0\r\n\r\n"), 505, "http_version_not_supported"},
        std::tuple{std::string("POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip\r\n\r\n"), 501,
                   "not_implemented"}}) {
    TestClient c(gw.port());
    c.send(req);
    auto r = c.read_response();
    REQUIRE(r.ok);
    check_error_shape(r, status, code);
    CHECK(json::parse(r.body)["error"]["type"] == "invalid_request_error");
  }
}

TEST_CASE("http: headers that never end get 408 and a close", "[gateway][http]") {
  HttpServerOptions o;
  o.request_timeout_ms = 150;
  TestGateway gw(o);
  TestClient c(gw.port());
  auto t0 = std::chrono::steady_clock::now();
  c.send("POST /v1/completions HTTP/1.1\r\nHost: t\r\n");
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  c.send("X-Slow: 1\r\n");  // trickling bytes do not extend the deadline
  auto r = c.read_response(3000);
  auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - t0).count();
  REQUIRE(r.ok);
  check_error_shape(r, 408, "request_timeout");
  CHECK(ms >= 140);
  CHECK(ms < 2000);
  CHECK(c.wait_closed());
}

TEST_CASE("http: a body that never finishes gets 408", "[gateway][http]") {
  HttpServerOptions o;
  o.request_timeout_ms = 150;
  TestGateway gw(o);
  TestClient c(gw.port());
  c.send("POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Length: 100\r\n\r\n{\"model\":");
  auto r = c.read_response(3000);
  REQUIRE(r.ok);
  CHECK(r.status == 408);
  CHECK(c.wait_closed());
}

TEST_CASE("http: an idle keep-alive connection is closed after the idle timeout", "[gateway][http]") {
  HttpServerOptions o;
  o.keepalive_timeout_ms = 100;
  TestGateway gw(o);
  TestClient c(gw.port());
  c.send("GET /v1/models HTTP/1.1\r\nHost: t\r\n\r\n");
  REQUIRE(c.read_response().ok);
  auto t0 = std::chrono::steady_clock::now();
  CHECK(c.wait_closed(3000));
  auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - t0).count();
  CHECK(ms >= 80);
}

TEST_CASE("http: HTTP/1.0 gets Connection: close and a close-delimited stream", "[gateway][http]") {
  TestGateway gw;
  TestClient c(gw.port());
  std::string body = R"({"model":"demo-moe","prompt":"x","max_tokens":3,"stream":true})";
  c.send("POST /v1/completions HTTP/1.0\r\nContent-Length: " + std::to_string(body.size()) + "\r\n\r\n" + body);
  auto r = c.read_response();
  REQUIRE(r.ok);
  CHECK(r.status == 200);
  CHECK(r.headers.count("transfer-encoding") == 0);
  CHECK(r.headers["connection"] == "close");
  auto ev = sse_events(r.body);
  REQUIRE_FALSE(ev.empty());
  CHECK(ev.back() == "[DONE]");
}

TEST_CASE("http: a silent stream gets SSE comment lines, which leave its events as they are", "[gateway][http]") {
  HttpServerOptions o;
  o.stream_ping_ms = 40;
  TestGateway gw(o);
  gw.scheduler().tick_ms_ = 150;  // a token every 150 ms: several pings between tokens
  TestClient c(gw.port());
  c.send(post("/v1/completions", R"({"model":"demo-moe","prompt":"x","max_tokens":3,"stream":true})"));
  auto r = c.read_response();
  REQUIRE(r.ok);
  CHECK(r.status == 200);
  size_t pings = 0;
  for (size_t at = r.body.find(": keep-alive\n\n"); at != std::string::npos; at = r.body.find(": keep-alive\n\n", at + 1))
    ++pings;
  CHECK(pings >= 3);
  auto ev = sse_events(r.body);  // comment lines are no events
  REQUIRE(ev.size() >= 4);       // three tokens (then the finish), then [DONE]
  CHECK(ev.back() == "[DONE]");
  std::string text;
  for (size_t i = 0; i + 1 < ev.size(); ++i) text += json::parse(ev[i])["choices"][0]["text"].get<std::string>();
  CHECK(text.size() == 3);
  // A response that is not a stream gets none.
  auto whole = http(gw.port(), "POST", "/v1/completions", R"({"model":"demo-moe","prompt":"x","max_tokens":2})");
  CHECK(whole.body.find("keep-alive") == std::string::npos);
}

TEST_CASE("http: --api-key guards every endpoint but /health", "[gateway][http][auth]") {
  ApiOptions api;
  api.api_keys = {"sekret"};
  TestGateway gw({}, api);
  check_error_shape(http(gw.port(), "GET", "/v1/models"), 401, "invalid_api_key");
  check_error_shape(http(gw.port(), "GET", "/v1/models", "", "Authorization: Bearer wrong\r\n"), 401,
                    "invalid_api_key");
  check_error_shape(http(gw.port(), "POST", "/v1/chat/completions", kChatBody), 401, "invalid_api_key");
  check_error_shape(http(gw.port(), "GET", "/metrics"), 401, "invalid_api_key");
  CHECK(http(gw.port(), "GET", "/health").status == 200);
  CHECK(http(gw.port(), "GET", "/v1/models", "", "Authorization: Bearer sekret\r\n").status == 200);
  auto ok = http(gw.port(), "POST", "/v1/chat/completions", kChatBody, "Authorization: Bearer sekret\r\n");
  CHECK(ok.status == 200);
  CHECK(gw.scheduler().submitted().size() == 1);
}

TEST_CASE("http: a client that reads too slowly is dropped and its sequence cancelled", "[gateway][http]") {
  HttpServerOptions o;
  o.max_write_queue_bytes = 64 * 1024;
  ApiOptions api;
  api.max_request_tokens = int64_t(1) << 40;  // the cost bound is not what this test is about
  TestGateway gw(o, api);
  // Endless output, fast: the kernel buffers fill, then the write queue.
  gw.scheduler().set_script([](const SequenceRequest&, int) { return int32_t{'z'}; });
  gw.scheduler().tokens_per_tick_ = 100;
  gw.scheduler().max_context_ = 1 << 30;  // no end in sight
  TestClient c(gw.port());
  c.shrink_receive_buffer();
  c.send(post("/v1/completions", R"({"model":"demo-moe","prompt":"x","stream":true})"));
  c.read_until("\r\n\r\n");
  // Never read again: the server must give up on us and cancel.
  REQUIRE(eventually([&] { return gw.scheduler().cancelled().size() == 1; }, 15000));
  CHECK(gw.scheduler().active() == 0);
  // (The bytes already in the kernel's buffers still trickle out through our
  // tiny window, so waiting for EOF here would take long.) Others are served.
  CHECK(http(gw.port(), "GET", "/v1/models").status == 200);
}
