// What no request or client may do to the gateway (docs/security.md), over
// real TCP with the scheduler double: each case was a way to end, starve or
// bloat the service, and the service must answer it with a clear error and
// go on serving everyone else.
#include <catch2/catch.hpp>

#include <cstdio>
#include <fstream>
#include <regex>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <stdexcept>
#include <thread>

#include <nlohmann/json.hpp>

#include "gateway/gateway_options.h"
#include "gateway/json_body.h"
#include "gateway/state/session_store.h"
#include "gateway_test_harness.h"

using namespace moe::gw;
using namespace moe::gw::test;
using nlohmann::json;

namespace {

const char* kChat = "/v1/chat/completions";

std::string chat_body(const std::string& content, const std::string& extra = "") {
  return R"({"model":"demo-moe","messages":[{"role":"user","content":")" + content + R"("}])" +
         (extra.empty() ? "" : "," + extra) + "}";
}

json error_of(const ClientResponse& r) {
  INFO(r.body);
  REQUIRE(r.ok);
  json j = json::parse(r.body, nullptr, false);
  REQUIRE(j.is_object());
  REQUIRE(j["error"].is_object());
  return j["error"];
}

void expect_error(const ClientResponse& r, int status, const char* code) {
  INFO(r.body);
  CHECK(r.status == status);
  CHECK(error_of(r)["code"] == code);
}

// A short ordinary request is answered (the script is set to a short one).
void still_serves(TestGateway& gw) {
  gw.scheduler().tick_ms_ = 1;
  gw.scheduler().set_script(spell("ok"));
  auto r = http(gw.port(), "POST", kChat, chat_body("hi"));
  INFO(r.body);
  REQUIRE(r.status == 200);
}

// The value of one unlabelled series of /metrics.
double metric(int port, const std::string& name, const std::string& auth = "") {
  auto r = http(port, "GET", "/metrics", "", auth);
  std::smatch m;
  const std::regex re("\n" + name + " ([0-9.e+-]+)\n");
  if (!std::regex_search(r.body, m, re)) return -1;
  return std::stod(m[1]);
}

// The prompt the scheduler was given, as text (ByteCodec: one id per byte).
std::string prompt_text(const SequenceRequest& r) {
  std::string s;
  for (int32_t id : r.prompt) s += char(id);
  return s;
}

// A codec whose text side throws: what a bug in it would do.
class ThrowingCodec final : public TextCodec {
 public:
  bool throw_in_template = true;
  std::vector<int32_t> encode(std::string_view text) const override { return inner_.encode(text); }
  moe::Result<std::vector<int32_t>> encode_chat(const json& messages) const override {
    if (throw_in_template) throw std::runtime_error("template blew up");
    return inner_.encode_chat(messages);
  }
  std::unique_ptr<TokenTextStream> stream_decoder() const override {
    struct Bad final : TokenTextStream {
      std::string push(int32_t) override { throw std::length_error("decoder blew up"); }
      std::string flush() override { return ""; }
    };
    return std::make_unique<Bad>();
  }
  std::string token_bytes(int32_t id) const override { return inner_.token_bytes(id); }
  int vocab_size() const override { return inner_.vocab_size(); }
  std::vector<int32_t> stop_token_ids() const override { return inner_.stop_token_ids(); }

 private:
  ByteCodec inner_;
};

// A codec whose text side waits at a gate the test opens: a request whose
// prompt takes as long to tokenise as the test wants.
class GatedCodec final : public TextCodec {
 public:
  std::vector<int32_t> encode(std::string_view text) const override {
    wait();
    return inner_.encode(text);
  }
  moe::Result<std::vector<int32_t>> encode_chat(const json& messages) const override {
    wait();
    return inner_.encode_chat(messages);
  }
  std::unique_ptr<TokenTextStream> stream_decoder() const override {
    if (gate_decoder) wait();
    return inner_.stream_decoder();
  }
  bool gate_decoder = false;  // ids to text wait at the gate too (/detokenize)
  std::string token_bytes(int32_t id) const override { return inner_.token_bytes(id); }
  int vocab_size() const override { return inner_.vocab_size(); }
  std::vector<int32_t> stop_token_ids() const override { return inner_.stop_token_ids(); }
  void open() {
    std::lock_guard<std::mutex> l(mu_);
    open_ = true;
    cv_.notify_all();
  }
  bool is_open() const {
    std::lock_guard<std::mutex> l(mu_);
    return open_;
  }
  int waiting() const { return waiting_.load(); }

 private:
  void wait() const {
    std::unique_lock<std::mutex> l(mu_);
    ++waiting_;
    cv_.wait(l, [&] { return open_; });
    --waiting_;
  }
  ByteCodec inner_;
  mutable std::mutex mu_;
  mutable std::condition_variable cv_;
  mutable std::atomic<int> waiting_{0};
  bool open_ = false;
};

}  // namespace

TEST_CASE("hardening: numbers outside the double range are 400, the gateway goes on", "[gateway][hardening]") {
  TestGateway gw;
  const std::string huge_int(400, '7');
  for (const std::string& extra : {std::string(R"("max_tokens":1e400)"), std::string(R"("temperature":-1e999)"),
                                   R"("seed":)" + huge_int, std::string(R"("stream_options":{"x":[1E+999]})")}) {
    INFO(extra);
    expect_error(http(gw.port(), "POST", kChat, chat_body("hi", extra)), 400, "invalid_json");
  }
  expect_error(http(gw.port(), "POST", "/v1/completions", R"({"model":"demo-moe","prompt":"x","n":1e400})"), 400,
               "invalid_json");
  still_serves(gw);
}

TEST_CASE("hardening: nesting past the bound is refused while parsing, sessions too", "[gateway][hardening]") {
  SessionStore store(nullptr, {});
  ApiOptions api;
  api.sessions = &store;
  TestGateway gw({}, api);
  // 300,000 levels: the old merge of a session's turns recursed through them.
  const std::string deep = std::string(300'000, '[') + std::string(300'000, ']');
  const std::string body = R"({"model":"demo-moe","session_id":"new","messages":[{"role":"user","content":)" + deep +
                           "}]}";
  expect_error(http(gw.port(), "POST", kChat, body), 400, "nesting_too_deep");
  expect_error(http(gw.port(), "POST", "/v1/completions", R"({"model":"demo-moe","prompt":)" + deep + "}"), 400,
               "nesting_too_deep");
  // Brackets inside strings are text, not nesting.
  auto ok = http(gw.port(), "POST", kChat, chat_body(std::string(1000, '[')));
  CHECK(ok.status == 200);
  CHECK(json_nesting_depth(R"({"a":"[[[[{{{{","b":[1,[2]]})") == 3);
  still_serves(gw);
}

TEST_CASE("hardening: a request's cost is bounded before it runs", "[gateway][hardening]") {
  TestGateway gw;
  gw.scheduler().max_context_ = 1 << 20;
  // n x max_tokens past 2^20.
  expect_error(http(gw.port(), "POST", kChat, chat_body("hi", R"("n":128,"max_tokens":100000)")), 400,
               "request_too_costly");
  // No max_tokens: the rest of a 2^20 context, 16 times over.
  expect_error(http(gw.port(), "POST", kChat, chat_body("hi", R"("n":16)")), 400, "request_too_costly");
  // Logprobs of a whole response: 16 x 1000 x 21 entries past 2^18.
  const std::string lp = R"("n":16,"max_tokens":1000,"logprobs":true,"top_logprobs":20)";
  expect_error(http(gw.port(), "POST", kChat, chat_body("hi", lp)), 400, "request_too_costly");
  // The same streamed keeps nothing: allowed.
  gw.scheduler().set_script(spell("ok"));
  auto streamed = http(gw.port(), "POST", kChat, chat_body("hi", lp + R"(,"stream":true)"));
  CHECK(streamed.status == 200);
  CHECK(sse_events(streamed.body).back() == "[DONE]");
  // max_tokens near 2^63 cannot overflow the context check.
  expect_error(http(gw.port(), "POST", kChat, chat_body("hi", R"("max_tokens":9223372036854775000)")), 400,
               "context_length_exceeded");
  expect_error(http(gw.port(), "POST", "/v1/completions",
                    R"({"model":"demo-moe","prompt":"x","max_tokens":9223372036854775807})"),
               400, "context_length_exceeded");
  // min_tokens without max_tokens must fit the context too.
  auto at_least = http(gw.port(), "POST", kChat, chat_body("hi", R"("min_tokens":1048576)"));
  expect_error(at_least, 400, "context_length_exceeded");
  CHECK(json::parse(at_least.body)["error"]["param"] == "min_tokens");
  CHECK(http(gw.port(), "POST", kChat, chat_body("hi", R"("min_tokens":2,"n":1)")).status == 200);
  // With no context known yet, the cost's message says the max_tokens asked, not a clamped one.
  gw.scheduler().max_context_ = 0;
  auto costly = http(gw.port(), "POST", "/v1/completions",
                     R"({"model":"demo-moe","prompt":"x","max_tokens":9223372036854775807})");
  expect_error(costly, 400, "request_too_costly");
  INFO(costly.body);
  CHECK(costly.body.find("1 x 9223372036854775807 = more than") != std::string::npos);
  gw.scheduler().max_context_ = 1 << 20;
  still_serves(gw);
}

TEST_CASE("hardening: a whole response past --max-response-bytes fails; the stream of it does not", "[gateway][hardening]") {
  ApiOptions api;
  api.max_response_bytes = 4096;
  TestGateway gw({}, api);
  gw.scheduler().max_context_ = 1 << 20;
  gw.scheduler().set_script([](const SequenceRequest&, int) { return int32_t{'x'}; });
  gw.scheduler().tokens_per_tick_ = 50;
  expect_error(http(gw.port(), "POST", kChat, chat_body("hi", R"("max_tokens":10000)")), 400, "response_too_large");
  CHECK(eventually([&] { return gw.scheduler().active() == 0; }));
  auto streamed = http(gw.port(), "POST", kChat, chat_body("hi", R"("max_tokens":10000,"stream":true)"));
  CHECK(streamed.status == 200);
  CHECK(streamed.body.find("response_too_large") == std::string::npos);
  gw.scheduler().set_script(spell("ok"));
  still_serves(gw);
}

TEST_CASE("hardening: whole responses together are bounded by --max-held-response-bytes (503)", "[gateway][hardening]") {
  ApiOptions api;
  api.max_response_bytes = 4096;
  api.max_held_response_bytes = 6000;
  TestGateway gw({}, api);
  gw.scheduler().max_context_ = 1 << 20;
  gw.scheduler().set_script([](const SequenceRequest&, int) { return int32_t{'x'}; });
  gw.scheduler().tick_ms_ = 20;
  gw.scheduler().tokens_per_tick_ = 50;  // 3,500 tokens: 70 ticks, 1.4 s
  auto metric = [&](const std::string& name) {
    const std::string body = http(gw.port(), "GET", "/metrics").body;
    const size_t at = body.find("\n" + name + " ");
    return at == std::string::npos ? -1.0 : std::stod(body.substr(at + name.size() + 2));
  };
  // Each within its own bound (3,500 of 4,096 bytes), together past 6,000:
  // the one that grows past it fails, the other is answered whole.
  const std::string body = chat_body("hi", R"("max_tokens":3500)");
  const std::string request = std::string("POST ") + kChat + " HTTP/1.1\r\nHost: x\r\nContent-Length: " +
                              std::to_string(body.size()) + "\r\n\r\n" + body;
  TestClient a(gw.port()), b(gw.port());
  a.send(request);
  REQUIRE(eventually([&] { return metric("moe_gateway_held_response_bytes") > 0; }));
  b.send(request);
  const ClientResponse ra = a.read_response(20000), rb = b.read_response(20000);
  REQUIRE((ra.ok && rb.ok));
  const ClientResponse& failed = ra.status == 200 ? rb : ra;
  const ClientResponse& whole = ra.status == 200 ? ra : rb;
  expect_error(failed, 503, "responses_memory_full");
  CHECK(failed.headers.at("retry-after") == "1");
  REQUIRE(whole.status == 200);
  CHECK(json::parse(whole.body)["choices"][0]["message"]["content"] == std::string(3500, 'x'));
  // All given back once both are over; a streamed response holds nothing.
  CHECK(eventually([&] { return metric("moe_gateway_held_response_bytes") == 0; }));
  CHECK(metric("moe_gateway_held_responses_refused_total") == 1);
  auto streamed = http(gw.port(), "POST", kChat, chat_body("hi", R"("max_tokens":3500,"stream":true)"));
  CHECK(streamed.status == 200);
  CHECK(metric("moe_gateway_held_response_bytes") == 0);
  gw.scheduler().set_script(spell("ok"));
  still_serves(gw);
}

TEST_CASE("hardening: a whole response's logprobs count what they cost in memory against --max-response-bytes",
          "[gateway][hardening]") {
  // Chat's 20 alternatives a token are ~11 KB a token as JSON nodes: 40
  // tokens pass 256 KiB (counted at 2.7 KB a token they did not, and one
  // request of n 128 held ~400 MB under a 64 MiB limit). Completions' are
  // one key each (~100 bytes): 40 tokens of their most, 5, fit.
  ApiOptions api;
  api.max_response_bytes = 256 << 10;
  TestGateway gw({}, api);
  gw.scheduler().set_script([](const SequenceRequest&, int) { return int32_t{'x'}; });
  expect_error(http(gw.port(), "POST", kChat,
                    chat_body("hi", R"("max_tokens":20,"n":2,"logprobs":true,"top_logprobs":20,"ignore_eos":true)")),
               400, "response_too_large");
  CHECK(eventually([&] { return gw.scheduler().active() == 0; }));
  auto completion = http(gw.port(), "POST", "/v1/completions",
                         R"({"model":"demo-moe","prompt":"x","max_tokens":20,"n":2,"logprobs":5,"ignore_eos":true})");
  INFO(completion.body);
  CHECK(completion.status == 200);
  still_serves(gw);
}

TEST_CASE("hardening: sequences in flight are bounded per caller and waiting ones in total (429)",
          "[gateway][hardening][admission]") {
  ApiOptions api;
  api.api_keys = {"key-a", "key-b"};
  api.admission.max_caller_sequences = 4;
  api.admission.max_waiting = 5;
  TestGateway gw({}, api);
  gw.scheduler().capacity_ = 0;  // nothing runs: everything admitted waits
  const std::string a = "Authorization: Bearer key-a\r\n", b = "Authorization: Bearer key-b\r\n";
  auto stream = [&](int n, const std::string& auth) {
    auto c = std::make_unique<TestClient>(gw.port());
    const std::string body = chat_body("hi", R"("stream":true,"n":)" + std::to_string(n));
    c->send("POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n" + auth +
            "Content-Type: application/json\r\nContent-Length: " + std::to_string(body.size()) + "\r\n\r\n" + body);
    c->read_until("\r\n\r\n");
    return c;
  };
  auto first = stream(3, a);
  REQUIRE(eventually([&] { return gw.scheduler().submitted().size() == 3; }));
  // Caller a: 3 in flight, 2 more would be 5 > 4.
  auto over = http(gw.port(), "POST", kChat, chat_body("hi", R"("n":2)"), a);
  expect_error(over, 429, "too_many_sequences");
  CHECK(over.headers["retry-after"] == "1");
  // Caller b is not held back by a's bound, but 3 wait already: 3 + 3 > 5.
  auto full = http(gw.port(), "POST", kChat, chat_body("hi", R"("n":3)"), b);
  expect_error(full, 429, "queue_full");
  CHECK(full.headers.count("retry-after") == 1);
  auto second = stream(2, b);  // 3 + 2 = 5 waiting: allowed
  REQUIRE(eventually([&] { return gw.scheduler().submitted().size() == 5; }));
  // a's stream gone: its sequences are given back.
  first->close();
  REQUIRE(eventually([&] { return gw.scheduler().cancelled().size() == 3; }));
  auto third = stream(3, a);
  CHECK(eventually([&] { return gw.scheduler().submitted().size() == 8; }));
  CHECK(metric(gw.port(), "moe_gateway_admission_refused_total", a) == 2);
}

TEST_CASE("hardening: a client that pipelines a megabyte and leaves is noticed mid-generation",
          "[gateway][hardening][http]") {
  TestGateway gw;
  gw.scheduler().max_context_ = 1 << 20;
  gw.scheduler().set_script([](const SequenceRequest&, int) { return int32_t{'z'}; });
  gw.scheduler().tick_ms_ = 5;  // 100,000 tokens would take minutes
  {
    TestClient c(gw.port());
    const std::string body = chat_body("hi", R"("max_tokens":100000)");
    c.send("POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: " + std::to_string(body.size()) +
           "\r\n\r\n" + body);
    REQUIRE(eventually([&] { return gw.scheduler().submitted().size() == 1; }));
    // Far more than one request's worth behind it, then gone.
    const std::string junk(1 << 20, 'G');
    c.send(junk);
    c.send(junk);
  }
  CHECK(eventually([&] { return gw.scheduler().cancelled().size() == 1; }, 5000));
  CHECK(gw.scheduler().active() == 0);
  still_serves(gw);
}

TEST_CASE("hardening: past --max-connections new clients get 503, the others are served", "[gateway][hardening][http]") {
  HttpServerOptions o;
  o.max_connections = 4;
  TestGateway gw(o);
  std::vector<std::unique_ptr<TestClient>> idle;
  for (int i = 0; i < 3; ++i) idle.push_back(std::make_unique<TestClient>(gw.port()));
  // Three idle ones and this one: four.
  TestClient fourth(gw.port());
  fourth.send("GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n");
  CHECK(fourth.read_response().status == 200);
  auto refused = http(gw.port(), "GET", "/v1/models");
  expect_error(refused, 503, "too_many_connections");
  CHECK(refused.headers["connection"] == "close");
  CHECK(refused.headers["retry-after"] == "1");
  // One leaves: room again.
  idle.pop_back();
  CHECK(eventually([&] { return http(gw.port(), "GET", "/v1/models").status == 200; }));
  fourth.send("GET /health HTTP/1.1\r\nHost: x\r\n\r\n");
  CHECK(fourth.read_response().status == 200);
}

TEST_CASE("hardening: a client that takes nothing of its response is closed after --write-timeout-ms",
          "[gateway][hardening][http]") {
  HttpServerOptions o;
  o.write_timeout_ms = 300;
  o.max_write_queue_bytes = size_t(1) << 30;  // the queue bound is not what closes it
  ApiOptions api;
  api.max_request_tokens = int64_t(1) << 40;
  TestGateway gw(o, api);
  gw.scheduler().set_script([](const SequenceRequest&, int) { return int32_t{'z'}; });
  gw.scheduler().tokens_per_tick_ = 200;
  gw.scheduler().max_context_ = 1 << 30;
  TestClient c(gw.port());
  c.shrink_receive_buffer();
  const std::string body = R"({"model":"demo-moe","prompt":"x","stream":true})";
  c.send("POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: " + std::to_string(body.size()) + "\r\n\r\n" +
         body);
  c.read_until("\r\n\r\n");
  // Never read again.
  CHECK(eventually([&] { return gw.scheduler().cancelled().size() == 1; }, 10000));
  CHECK(gw.scheduler().active() == 0);
  still_serves(gw);
}

TEST_CASE("hardening: a session belongs to its caller's key; without keys ids are the server's",
          "[gateway][hardening][sessions]") {
  SessionStoreOptions so;
  so.max_messages = 4;
  SessionStore store(nullptr, so);
  ApiOptions api;
  api.sessions = &store;
  api.api_keys = {"alice-key", "bob-key"};
  TestGateway gw({}, api);
  gw.scheduler().set_script(spell("ack"));
  const std::string alice = "Authorization: Bearer alice-key\r\n", bob = "Authorization: Bearer bob-key\r\n";
  auto turn = [&](const std::string& who, const std::string& text, const std::string& sid) {
    return http(gw.port(), "POST", kChat, chat_body(text, R"("session_id":")" + sid + R"(")"), who);
  };
  REQUIRE(turn(alice, "alice secret", "notes").status == 200);
  // Bob names the same id: an empty session of his own.
  auto b1 = turn(bob, "bob here", "notes");
  REQUIRE(b1.status == 200);
  CHECK(b1.headers["x-session-id"] == "notes");
  CHECK(prompt_text(gw.scheduler().submitted().back()).find("alice secret") == std::string::npos);
  // Alice continues hers.
  REQUIRE(turn(alice, "second", "notes").status == 200);
  const std::string p = prompt_text(gw.scheduler().submitted().back());
  CHECK(p.find("alice secret") != std::string::npos);
  CHECK(p.find("bob here") == std::string::npos);
  // Four turns kept: after the third exchange the first one is gone.
  REQUIRE(turn(alice, "third", "notes").status == 200);
  REQUIRE(turn(alice, "fourth", "notes").status == 200);
  const std::string q = prompt_text(gw.scheduler().submitted().back());
  CHECK(q == "user: second\nassistant: ack\nuser: third\nassistant: ack\nuser: fourth\nassistant:");
}

TEST_CASE("hardening: without API keys a session id must be one the server issued", "[gateway][hardening][sessions]") {
  SessionStore store(nullptr, {});
  ApiOptions api;
  api.sessions = &store;
  TestGateway gw({}, api);
  gw.scheduler().set_script(spell("ack"));
  // A guessable id is refused.
  expect_error(http(gw.port(), "POST", kChat, chat_body("hi", R"("session_id":"story-1")")), 400,
               "invalid_session_id");
  expect_error(http(gw.port(), "POST", kChat, chat_body("hi", R"("session_id":17)")), 400, "invalid_type");
  expect_error(http(gw.port(), "POST", kChat, chat_body("hi", R"("session_id":"")")), 400, "invalid_session_id");
  // One of the issued shape that the server never issued is no session
  // (a client picking it would share a conversation with any other that did).
  expect_error(http(gw.port(), "POST", kChat,
                    chat_body("hi", R"("session_id":"s-0123456789abcdef0123456789abcdef")")),
               404, "session_not_found");
  CHECK(store.in_memory() == 0);
  auto first = http(gw.port(), "POST", kChat, chat_body("remember me", R"("session_id":"new")"));
  REQUIRE(first.status == 200);
  const std::string id = first.headers["x-session-id"];
  CHECK(std::regex_match(id, std::regex("s-[0-9a-f]{32}")));
  auto second = http(gw.port(), "POST", kChat, chat_body("and now"), "X-Session-Id: " + id + "\r\n");
  REQUIRE(second.status == 200);
  CHECK(prompt_text(gw.scheduler().submitted().back()).find("remember me") != std::string::npos);
  // Another new session shares nothing.
  auto other = http(gw.port(), "POST", kChat, chat_body("fresh", R"("session_id":"new")"));
  CHECK(other.headers["x-session-id"] != id);
  CHECK(prompt_text(gw.scheduler().submitted().back()).find("remember me") == std::string::npos);
  // The header and the body naming two sessions (a client asking for a new
  // one with an old header left on) is refused, not settled silently.
  const size_t before = gw.scheduler().submitted().size();
  auto both = http(gw.port(), "POST", kChat, chat_body("which?", R"("session_id":"new")"), "X-Session-Id: " + id + "\r\n");
  expect_error(both, 400, "conflicting_session_id");
  CHECK(gw.scheduler().submitted().size() == before);
  // Both naming the same one is that one.
  auto same = http(gw.port(), "POST", kChat, chat_body("same", R"("session_id":")" + id + "\""),
                   "X-Session-Id: " + id + "\r\n");
  REQUIRE(same.status == 200);
  CHECK(prompt_text(gw.scheduler().submitted().back()).find("remember me") != std::string::npos);
}

TEST_CASE("hardening: a second turn of a session while one runs is 409; no turn is lost", "[gateway][hardening][sessions]") {
  SessionStore store(nullptr, {});
  ApiOptions api;
  api.sessions = &store;
  api.api_keys = {"alice-key"};
  TestGateway gw({}, api);
  gw.scheduler().set_script(spell("ack"));
  gw.scheduler().tick_ms_ = 100;  // a turn takes a while
  const std::string alice = "Authorization: Bearer alice-key\r\n";
  auto turn = [&](const std::string& text) {
    return http(gw.port(), "POST", kChat, chat_body(text, R"("session_id":"talk")"), alice);
  };
  std::thread first([&] { CHECK(turn("first question").status == 200); });
  for (int i = 0; i < 200 && gw.scheduler().active() == 0; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  REQUIRE(gw.scheduler().active() == 1);
  auto second = turn("second question");
  expect_error(second, 409, "session_busy");
  CHECK(second.headers["retry-after"] == "1");
  first.join();
  gw.scheduler().tick_ms_ = 1;
  REQUIRE(turn("third question").status == 200);
  const std::string p = prompt_text(gw.scheduler().submitted().back());
  CHECK(p.find("first question") != std::string::npos);
  CHECK(p.find("second question") == std::string::npos);
  // Another session of the same caller is not held up by it.
  std::thread slow([&] { CHECK(turn("fourth").status == 200); });
  for (int i = 0; i < 200 && gw.scheduler().active() == 0; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  CHECK(http(gw.port(), "POST", kChat, chat_body("elsewhere", R"("session_id":"other")"), alice).status == 200);
  slow.join();
}

TEST_CASE("hardening: the session mirror counts what its turns take in memory, not their text alone",
          "[gateway][hardening][sessions]") {
  // Empty turns with long keys: text of a few bytes, objects and strings of
  // hundreds (the mirror's bound was 5x under what the process held).
  SessionStoreOptions so;
  so.memory_bytes = size_t(1) << 20;
  SessionStore store(nullptr, so);
  ChatMessages turns;
  for (int i = 0; i < 64; ++i) {
    ChatMessage m{i % 2 ? "assistant" : "user", ""};
    m.request_key = std::string(128, 'k');
    turns.push_back(m);
  }
  store.save({SessionStore::open_owner(), "s-one"}, turns);
  CHECK(store.memory_bytes() >= 64 * (sizeof(ChatMessage) + 128));
  for (int i = 0; i < 200; ++i) store.save({SessionStore::open_owner(), "s-" + std::to_string(i)}, turns);
  CHECK(store.memory_bytes() <= so.memory_bytes);
  CHECK(store.in_memory() < 200);  // the least recently used went
}

TEST_CASE("hardening: one caller's new sessions push out its own, not every other caller's",
          "[gateway][hardening][sessions]") {
  SessionStoreOptions so;
  so.memory_bytes = size_t(1) << 20;  // a share of 128 KiB a caller
  SessionStore store(nullptr, so);
  const ChatMessages turns = {{"user", std::string(20000, 'q')}, {"assistant", "a"}};
  // Others' conversations first, then one caller saving new ones without end.
  for (int i = 0; i < 4; ++i)
    store.save({SessionStore::open_owner(), "s-victim-" + std::to_string(i), "addr:10.0.0." + std::to_string(i)}, turns);
  for (int i = 0; i < 500; ++i)
    store.save({SessionStore::open_owner(), "s-flood-" + std::to_string(i), "addr:10.6.6.6"}, turns);
  CHECK(store.memory_bytes("addr:10.6.6.6") <= so.memory_bytes / 8);
  CHECK(store.memory_bytes() <= so.memory_bytes);
  for (int i = 0; i < 4; ++i) {
    ChatMessages got;
    store.load({SessionStore::open_owner(), "s-victim-" + std::to_string(i), "addr:10.0.0." + std::to_string(i)},
               [&](ChatMessages m, bool) { got = std::move(m); });
    CHECK(got == turns);
  }
  // The flood keeps its newest.
  ChatMessages newest;
  store.load({SessionStore::open_owner(), "s-flood-499", "addr:10.6.6.6"}, [&](ChatMessages m, bool) { newest = m; });
  CHECK(newest == turns);
  // Gone sessions give their bytes back to their caller's count.
  CHECK(store.memory_bytes("addr:10.0.0.0") > 0);
}

TEST_CASE("hardening: the store keeps the newest turns within its caps", "[gateway][hardening][sessions]") {
  ChatMessages m = {{"system", "be brief"}, {"user", "1"}, {"assistant", "a1"}, {"user", "2"}, {"assistant", "a2"}};
  auto c = SessionStore::capped(m, 3, 1 << 20);
  REQUIRE(c.size() == 3);
  CHECK(c[0].content == "be brief");  // the system turn stays while it fits
  CHECK(c[1].content == "2");
  CHECK(c[2].content == "a2");
  // Bytes (role + content): the system turn (14) no longer fits beside the
  // newest (11); the newest turns that fit stay.
  auto b = SessionStore::capped(m, 100, 16);
  REQUIRE(b.size() == 2);
  CHECK(b[0].content == "2");
  CHECK(b[1].content == "a2");
  // Not even the newest fits: the end of its text stays (whole characters).
  ChatMessages big = {{"user", "old"}, {"assistant", std::string(100, 'x') + "\xc3\xa9nd"}};
  auto t = SessionStore::capped(big, 10, 20);
  REQUIRE(t.size() == 1);
  CHECK(t[0].role == "assistant");
  CHECK(t[0].content == std::string(7, 'x') + "\xc3\xa9nd");  // 9 (role) + 11 bytes
  auto cut = SessionStore::capped(big, 10, 12);  // 3 bytes of room would start inside the é
  REQUIRE(cut.size() == 1);
  CHECK(cut[0].content == "nd");
  auto s = SessionStore::capped(m, 100, 30);
  REQUIRE(s.size() == 3);
  CHECK(s[0].role == "system");
  CHECK(s[1].content == "2");
  CHECK(s[2].content == "a2");
}

// Opens the codec's gate when the scope ends, however it ends, and joins
// the client threads after: a loop held up by a tokenisation (the defect
// these tests look for) fails them instead of hanging them; a watchdog
// opens it after 20 s in any case.
struct GateScope {
  GatedCodec& codec;
  std::vector<std::thread> threads;
  std::atomic<bool> done{false};
  std::thread watchdog;
  explicit GateScope(GatedCodec& c) : codec(c) {
    watchdog = std::thread([this] {
      for (int i = 0; i < 2000 && !done; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(10));
      codec.open();
    });
  }
  ~GateScope() {
    done = true;
    codec.open();
    for (auto& t : threads) t.join();
    watchdog.join();
  }
};

std::string post(const std::string& path, const std::string& body, const std::string& extra = "") {
  return "POST " + path + " HTTP/1.1\r\nHost: x\r\n" + extra + "Content-Length: " + std::to_string(body.size()) +
         "\r\n\r\n" + body;
}

// A request's client address as a trusted proxy (127.0.0.1) forwards it.
std::string from(const std::string& address) { return "X-Forwarded-For: " + address + "\r\n"; }

TEST_CASE("hardening: a request being tokenised holds up no other connection", "[gateway][hardening]") {
  GatedCodec codec;
  TestGateway gw({}, {}, &codec);
  ClientResponse tok, chat;
  {
    GateScope gate(codec);
    gate.threads.emplace_back([&] { tok = http(gw.port(), "POST", "/tokenize", R"({"prompt":"hello"})"); });
    gate.threads.emplace_back([&] { chat = http(gw.port(), "POST", kChat, chat_body("hi")); });
    // Both are read and wait at the gate at once: neither holds the loop
    // (libuv's pool has four threads).
    CHECK(eventually([&] { return codec.waiting() == 2; }, 10000));
    // Meanwhile other clients are answered.
    CHECK(http(gw.port(), "GET", "/health").status == 200);
    CHECK(http(gw.port(), "GET", "/v1/models").status == 200);
    CHECK(http(gw.port(), "POST", "/detokenize", R"({"tokens":[104,105]})").status == 200);
    CHECK_FALSE(codec.is_open());  // all of it while both still waited
  }
  CHECK(tok.status == 200);
  CHECK(json::parse(tok.body)["count"] == 5);
  CHECK(chat.status == 200);
}

TEST_CASE("hardening: a /detokenize being decoded holds up no other connection", "[gateway][hardening]") {
  GatedCodec codec;
  codec.gate_decoder = true;
  TestGateway gw({}, {}, &codec);
  ClientResponse detok;
  {
    GateScope gate(codec);
    gate.threads.emplace_back([&] { detok = http(gw.port(), "POST", "/detokenize", R"({"tokens":[104,105]})"); });
    CHECK(eventually([&] { return codec.waiting() == 1; }, 10000));
    CHECK(http(gw.port(), "GET", "/health").status == 200);
    CHECK(http(gw.port(), "GET", "/v1/models").status == 200);
    CHECK_FALSE(codec.is_open());  // answered while the decode still waited
  }
  CHECK(detok.status == 200);
  CHECK(json::parse(detok.body)["prompt"] == "hi");
  // An id past int64 is out of range, said as sent.
  auto huge = http(gw.port(), "POST", "/detokenize", R"({"tokens":[9223372036854775808]})");
  CHECK(huge.status == 400);
  CHECK(huge.body.find("9223372036854775808") != std::string::npos);
}

TEST_CASE("hardening: requests waiting to be tokenised are bounded, and dropped when their client leaves",
          "[gateway][hardening]") {
  GatedCodec codec;
  ApiOptions api;
  api.trusted_proxies = {"127.0.0.1"};  // each client below its own caller: no share binds
  TestGateway gw({}, api, &codec);
  {
    GateScope gate(codec);
    // Four fill the pool's threads, at the gate.
    std::vector<std::unique_ptr<TestClient>> held;
    for (int i = 0; i < 4; ++i) {
      held.push_back(std::make_unique<TestClient>(gw.port()));
      held.back()->send(post("/tokenize", R"({"prompt":"held"})", from("10.0.0." + std::to_string(i))));
    }
    REQUIRE(eventually([&] { return codec.waiting() == 4; }, 10000));
    // Queued behind them, then gone: taken off the queue at once.
    {
      TestClient leaver(gw.port());
      leaver.send(post(kChat, chat_body("bye")));
      REQUIRE(eventually([&] { return gw.api().jobs_in_flight() == 5; }));
    }
    CHECK(eventually([&] { return gw.api().jobs_in_flight() == 4; }));
    // Up to 64 wait; the next is told to come back.
    std::vector<std::unique_ptr<TestClient>> queued;
    for (int i = 0; i < 60; ++i) {
      queued.push_back(std::make_unique<TestClient>(gw.port()));
      queued.back()->send(post("/tokenize", R"({"prompt":"queued"})", from("10.0.1." + std::to_string(i))));
    }
    REQUIRE(eventually([&] { return gw.api().jobs_in_flight() == 64; }));
    auto busy = http(gw.port(), "POST", "/tokenize", R"({"prompt":"one more"})", from("10.0.2.1"));
    expect_error(busy, 503, "server_busy");
    CHECK(busy.headers["retry-after"] == "1");
    CHECK(http(gw.port(), "GET", "/health").status == 200);
    codec.open();
    for (auto& c : held) CHECK(c->read_response(10000).status == 200);
    for (auto& c : queued) CHECK(c->read_response(10000).status == 200);
  }
  CHECK(eventually([&] { return gw.api().jobs_in_flight() == 0; }));
  CHECK(gw.scheduler().submitted().empty());  // the chat that left never ran
}

TEST_CASE("hardening: one caller flooding the tokeniser's queue with long prompts leaves the other half to everyone else",
          "[gateway][hardening]") {
  GatedCodec codec;
  ApiOptions api;
  api.trusted_proxies = {"127.0.0.1"};
  TestGateway gw({}, api, &codec);
  const std::string flooder = from("10.6.6.6"), honest = from("10.1.1.1");
  // Large: a body of 64 KiB or more, which takes a pool thread long.
  const std::string long_text(70 * 1024, 'a');
  const std::string long_prompt = json{{"prompt", long_text}}.dump();
  std::string long_ids = "[104";
  while (long_ids.size() < 70 * 1024) long_ids += ",104";
  const std::string long_detok = R"({"tokens":)" + long_ids + "]}";
  GateScope gate(codec);
  std::vector<std::unique_ptr<TestClient>> queued;
  auto queue = [&](const std::string& path, const std::string& body, const std::string& who) {
    queued.push_back(std::make_unique<TestClient>(gw.port()));
    queued.back()->send(post(path, body, who));
  };
  for (int i = 0; i < 4; ++i) queue("/tokenize", R"({"prompt":"held"})", from("10.0.0." + std::to_string(i)));
  REQUIRE(eventually([&] { return codec.waiting() == 4; }, 10000));
  // One caller takes places while fewer than half (32) are taken...
  for (int i = 0; i < 28; ++i) queue(i % 2 ? "/tokenize" : kChat, i % 2 ? long_prompt : chat_body(long_text), flooder);
  REQUIRE(eventually([&] { return gw.api().jobs_in_flight() == 32; }));
  // ...then, holding more than its share (8) of large ones, it is told to wait for a large one,
  // whatever it asks.
  for (const auto& [path, body] : {std::pair<std::string, std::string>{"/tokenize", long_prompt},
                                   {kChat, chat_body(long_text)}, {"/detokenize", long_detok}}) {
    INFO(path);
    auto refused = http(gw.port(), "POST", path, body, flooder);
    expect_error(refused, 429, "too_many_requests_reading");
    CHECK(refused.headers["retry-after"] == "1");
  }
  // A short one of its own still passes.
  queue(kChat, chat_body("short"), flooder);
  REQUIRE(eventually([&] { return gw.api().jobs_in_flight() == 33; }));
  // Another caller still gets its share of large ones in the half left, then is told to wait too.
  for (int i = 0; i < 8; ++i) queue(kChat, chat_body(long_text), honest);
  REQUIRE(eventually([&] { return gw.api().jobs_in_flight() == 41; }));
  expect_error(http(gw.port(), "POST", kChat, chat_body(long_text), honest), 429, "too_many_requests_reading");
  // Short requests, and each caller after it, are served.
  queue(kChat, chat_body("short"), honest);
  queue("/tokenize", long_prompt, from("10.2.2.2"));
  REQUIRE(eventually([&] { return gw.api().jobs_in_flight() == 43; }));
  auto m = http(gw.port(), "GET", "/metrics");
  CHECK(m.body.find("moe_gateway_reading_refused_total 4\n") != std::string::npos);
  codec.open();
  // Every place taken is answered: read, and (the long chats) past the context.
  for (auto& c : queued) {
    const ClientResponse r = c->read_response(20000);
    REQUIRE(r.ok);
    if (r.status != 200) expect_error(r, 400, "context_length_exceeded");
  }
  CHECK(eventually([&] { return gw.api().jobs_in_flight() == 0; }));
  // Its requests all read, the flooder is welcome again.
  CHECK(http(gw.port(), "POST", "/tokenize", long_prompt, flooder).status == 200);
}

TEST_CASE("hardening: a request is checked against the context of the workers serving when its parse ends",
          "[gateway][hardening]") {
  GatedCodec codec;
  TestGateway gw({}, {}, &codec);
  ClientResponse r;
  {
    GateScope gate(codec);
    gate.threads.emplace_back(
        [&] { r = http(gw.port(), "POST", "/v1/completions", R"({"model":"demo-moe","prompt":"twenty bytes of text"})"); });
    REQUIRE(eventually([&] { return codec.waiting() == 1; }, 10000));
    // A worker with a 16-token context takes over while the prompt is read.
    gw.scheduler().max_context_ = 16;
  }
  expect_error(r, 400, "context_length_exceeded");
}

TEST_CASE("hardening: an exception in the text side is a 500 for that request only", "[gateway][hardening]") {
  ThrowingCodec codec;
  TestGateway gw({}, {}, &codec);
  auto r = http(gw.port(), "POST", kChat, chat_body("hi"));
  expect_error(r, 500, "internal_error");
  CHECK(error_of(r)["type"] == "server_error");
  // A whole response and a stream whose decoder throws mid-generation.
  auto whole = http(gw.port(), "POST", "/v1/completions", R"({"model":"demo-moe","prompt":"x"})");
  expect_error(whole, 500, "internal_error");
  auto streamed = http(gw.port(), "POST", "/v1/completions", R"({"model":"demo-moe","prompt":"x","stream":true})");
  CHECK(streamed.status == 200);
  CHECK(streamed.body.find("internal_error") != std::string::npos);
  CHECK(eventually([&] { return gw.scheduler().active() == 0; }));
  CHECK(metric(gw.port(), "moe_gateway_internal_errors_total") >= 3);
  CHECK(http(gw.port(), "GET", "/v1/models").status == 200);
}

TEST_CASE("hardening: without the key even unknown routes say nothing but 401", "[gateway][hardening][auth]") {
  ApiOptions api;
  api.api_keys = {"k1", "k2"};
  TestGateway gw({}, api);
  expect_error(http(gw.port(), "GET", "/no/such/route"), 401, "invalid_api_key");
  expect_error(http(gw.port(), "POST", "/debug/experts", "{}"), 401, "invalid_api_key");
  expect_error(http(gw.port(), "GET", "/no/such/route", "", "Authorization: Bearer k3\r\n"), 401, "invalid_api_key");
  expect_error(http(gw.port(), "GET", "/no/such/route", "", "Authorization: Bearer k2\r\n"), 404, "unknown_url");
  CHECK(http(gw.port(), "GET", "/v1/models", "", "Authorization: Bearer k1\r\n").status == 200);
  CHECK(http(gw.port(), "GET", "/health").status == 200);
}

TEST_CASE("hardening: keys come from files and the environment; no timeout can be switched off",
          "[gateway][hardening][options]") {
  char path[] = "/tmp/moe-keys-XXXXXX";
  const int fd = ::mkstemp(path);
  REQUIRE(fd >= 0);
  ::close(fd);
  {
    std::ofstream f(path);
    f << "# the team's keys\n  first-key  \n\nsecond-key\n";
  }
  auto cl = parse_gateway_args({"--model", "m", "--api-key-file", path, "--api-key", "cli-key"});
  REQUIRE(cl.ok());
  auto keys = collect_api_keys(cl->options, "env-key");
  REQUIRE(keys.ok());
  CHECK(keys.value() == std::vector<std::string>{"cli-key", "first-key", "second-key", "env-key"});
  {
    std::ofstream f(path, std::ios::trunc);
    f << "# nothing but comments\n";
  }
  CHECK_FALSE(collect_api_keys(cl->options, nullptr).ok());
  std::remove(path);
  CHECK_FALSE(collect_api_keys(cl->options, nullptr).ok());
  for (const char* opt : {"--request-timeout-ms", "--keepalive-timeout-ms", "--write-timeout-ms"}) {
    auto zero = parse_gateway_args({"--model", "m", opt, "0"});
    REQUIRE_FALSE(zero.ok());
    CHECK(zero.error().find(opt) != std::string::npos);
  }
}
