// The worker's Redis state and the gateway's reader of it, against a real
// redis-server of the test's own (a free port, a temp dir, stopped at the
// end): what the worker's real WorkerRedisState writes, the gateway's real
// RedisWorkerStreams reads back, and the other way round for warm hints and
// session events. The raw entries are checked byte for byte against the
// keys and fields earlier releases wrote (spelled out here on purpose), so
// that Redis state left by a running deployment stays readable.
#include <hiredis/hiredis.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>
#include <uv.h>

#include <algorithm>
#include <catch2/catch.hpp>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "gateway/state/redis_client.h"
#include "gateway/state/redis_worker_streams.h"
#include "gateway/state/session_store.h"
#include "worker/backend.h"
#include "worker/model_hello.h"
#include "worker/redis_state.h"
#include "protocol/redis_schema.h"

namespace pr = moe::protocol;
namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

namespace {

const char* kRedisServer = "/usr/bin/redis-server";

int free_port() {
  const int s = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(a);
  if (s < 0 || ::bind(s, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0 ||
      ::getsockname(s, reinterpret_cast<sockaddr*>(&a), &len) != 0) {
    if (s >= 0) ::close(s);
    return -1;
  }
  ::close(s);
  return ntohs(a.sin_port);
}

// A blocking connection of the test's own, to look at the raw bytes.
struct RawRedis {
  redisContext* ctx = nullptr;
  explicit RawRedis(int port) {
    timeval tv{1, 0};
    ctx = redisConnectWithTimeout("127.0.0.1", port, tv);
  }
  ~RawRedis() {
    if (ctx) redisFree(ctx);
  }
  bool ok() const { return ctx && !ctx->err; }
  // The reply; nullptr when the connection failed. The caller frees it.
  redisReply* cmd(const std::vector<std::string>& args) {
    std::vector<const char*> argv;
    std::vector<size_t> lens;
    for (const auto& a : args) {
      argv.push_back(a.data());
      lens.push_back(a.size());
    }
    return static_cast<redisReply*>(
        redisCommandArgv(ctx, int(argv.size()), argv.data(), lens.data()));
  }
  std::string text(const std::vector<std::string>& args) {
    redisReply* r = cmd(args);
    std::string out;
    if (r && (r->type == REDIS_REPLY_STRING || r->type == REDIS_REPLY_STATUS))
      out.assign(r->str, r->len);
    if (r && r->type == REDIS_REPLY_INTEGER) out = std::to_string(r->integer);
    if (r) freeReplyObject(r);
    return out;
  }
  // Every entry of a stream, oldest first, as its flat fields.
  std::vector<pr::StreamFields> entries(const std::string& key) {
    std::vector<pr::StreamFields> out;
    redisReply* r = cmd({"XRANGE", key, "-", "+"});
    for (size_t i = 0; r && r->type == REDIS_REPLY_ARRAY && i < r->elements; ++i) {
      const redisReply* f = r->element[i]->element[1];
      pr::StreamFields fields;
      for (size_t k = 0; k < f->elements; ++k)
        fields.emplace_back(f->element[k]->str, f->element[k]->len);
      out.push_back(std::move(fields));
    }
    if (r) freeReplyObject(r);
    return out;
  }
  // Events read by the group but not yet acknowledged.
  long long pending(const std::string& key) {
    redisReply* r = cmd({"XPENDING", key, "workers"});
    long long n = -1;
    if (r && r->type == REDIS_REPLY_ARRAY && r->elements >= 1 &&
        r->element[0]->type == REDIS_REPLY_INTEGER)
      n = r->element[0]->integer;
    if (r) freeReplyObject(r);
    return n;
  }
  bool has_group(const std::string& key) {
    redisReply* r = cmd({"XINFO", "GROUPS", key});
    const bool yes = r && r->type == REDIS_REPLY_ARRAY && r->elements == 1;
    if (r) freeReplyObject(r);
    return yes;
  }
};

// redis-server on a free port of 127.0.0.1, its files in a fresh temp dir,
// nothing saved; SIGTERM (SIGKILL if it lingers) when the test ends.
struct RedisServer {
  pid_t pid = -1;
  int port = -1;
  std::string dir;
  RedisServer() {
    char tmpl[] = "/tmp/moe-redis-roundtrip-XXXXXX";
    REQUIRE(::mkdtemp(tmpl));
    dir = tmpl;
    port = free_port();
    REQUIRE(port > 0);
    std::vector<std::string> args = {kRedisServer,
                                     "--port",
                                     std::to_string(port),
                                     "--bind",
                                     "127.0.0.1",
                                     "--dir",
                                     dir,
                                     "--save",
                                     "",
                                     "--appendonly",
                                     "no",
                                     "--daemonize",
                                     "no",
                                     "--logfile",
                                     dir + "/redis.log"};
    pid = ::fork();
    if (pid == 0) {
      std::vector<char*> argv;
      for (auto& a : args) argv.push_back(a.data());
      argv.push_back(nullptr);
      ::execv(argv[0], argv.data());
      _exit(127);
    }
    REQUIRE(pid > 0);
    for (int i = 0; i < 200; ++i) {
      RawRedis r(port);
      if (r.ok() && r.text({"PING"}) == "PONG") return;
      std::this_thread::sleep_for(std::chrono::milliseconds(25));
    }
    FAIL("redis-server did not answer on port " << port);
  }
  ~RedisServer() {
    if (pid > 0) {
      ::kill(pid, SIGTERM);
      int status = 0;
      for (int i = 0; i < 200 && ::waitpid(pid, &status, WNOHANG) == 0; ++i)
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
      if (::waitpid(pid, &status, WNOHANG) == 0) {
        ::kill(pid, SIGKILL);
        ::waitpid(pid, &status, 0);
      }
    }
    std::error_code ec;
    fs::remove_all(dir, ec);
  }
  std::string url() const { return "redis://127.0.0.1:" + std::to_string(port); }
};

// A backend of bookkeeping only: the residency the Redis state reports and
// restores, and what it was asked to warm. Called on the test's thread only
// (the worker's step thread).
class FakeBackend final : public moe::worker::Backend {
 public:
  FakeBackend(std::string model_id, std::set<std::pair<int, int>> resident)
      : model_id_(std::move(model_id)), resident_(std::move(resident)) {}
  pr::Hello describe() const override {
    pr::Hello h;
    h.model_id = model_id_;
    h.experts.n_moe_layers = 2;
    h.experts.n_experts = 4;
    return h;
  }
  pr::StepReply step(const pr::StepRequest&) override { return {}; }
  void release(uint64_t) override {}
  int kv_blocks_total() const override { return 0; }
  int kv_blocks_free() const override { return 0; }
  int sequences_active() const override { return 0; }
  size_t warm(const std::vector<pr::ExpertRef>& experts) override {
    warmed.push_back(experts);
    const size_t before = resident_.size();
    for (const auto& e : experts) resident_.insert({e.layer, e.expert});
    if (resident_.size() != before) ++version_;
    return experts.size();
  }
  std::vector<pr::ExpertRef> resident() const override {
    std::vector<pr::ExpertRef> out;
    for (const auto& [l, e] : resident_) out.push_back({uint16_t(l), uint16_t(e)});
    return out;
  }
  uint64_t residency_version() const override { return version_; }

  std::vector<std::vector<pr::ExpertRef>> warmed;

 private:
  std::string model_id_;
  std::set<std::pair<int, int>> resident_;
  uint64_t version_ = 1;
};

// The gateway's loop, turned by hand while the test waits for something.
// Whether redis-server is there to start; says the test is skipped when not.
bool have_redis_server() {
  if (::access(kRedisServer, X_OK) == 0) return true;
  std::puts("SKIPPED: no redis-server");
  WARN("SKIPPED: no redis-server");
  return false;
}

struct Loop {
  uv_loop_t loop{};
  Loop() { uv_loop_init(&loop); }
  ~Loop() {
    for (int i = 0; i < 100 && uv_run(&loop, UV_RUN_NOWAIT) != 0; ++i)
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    uv_loop_close(&loop);
  }
  // Turns the loop until `done()` or `ms` have passed; then `done()`.
  bool until(const std::function<bool()>& done, int ms = 10000) {
    const auto deadline = Clock::now() + std::chrono::milliseconds(ms);
    while (!done() && Clock::now() < deadline) {
      uv_run(&loop, UV_RUN_NOWAIT);
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
    return done();
  }
};

// A session's turns as the store loads them, the loop turned until they
// come; `known`: whether anything is stored under its key.
moe::gw::ChatMessages load_session(Loop& loop, moe::gw::SessionStore& store, const moe::gw::SessionKey& sk,
                                   bool* known = nullptr) {
  bool done = false;
  moe::gw::ChatMessages back;
  store.load(sk, [&](moe::gw::ChatMessages m, bool stored) {
    back = std::move(m);
    if (known) *known = stored;
    done = true;
  });
  REQUIRE(loop.until([&] { return done; }));
  return back;
}

}  // namespace

TEST_CASE("the worker and the gateway name a model's keys alike", "[redis][roundtrip]") {
  for (const std::string path :
       {"models/demo-moe", "models/demo-moe/", "/srv/models/qwen3.moe", "demo-moe"}) {
    INFO(path);
    CHECK(moe::gw::redis_model_name(path) == moe::worker::model_id_from_path(path));
  }
}

TEST_CASE("what the worker writes to Redis, the gateway reads back, and the other way round",
          "[redis][roundtrip]") {
  if (!have_redis_server()) return;
  RedisServer server;
  RawRedis raw(server.port);
  REQUIRE(raw.ok());

  // Both sides derive the model's name from the same --model path.
  const std::string model_path = "/srv/models/demo-moe/";
  const std::string worker_model = moe::worker::model_id_from_path(model_path);
  const std::string gateway_model = moe::gw::redis_model_name(model_path);
  REQUIRE(worker_model == "demo-moe");
  REQUIRE(gateway_model == worker_model);

  // ---- the worker: re-warm from an empty Redis, then its snapshot.
  FakeBackend backend(worker_model, {{1, 3}, {0, 2}, {0, 1}});
  moe::worker::WorkerRedisOptions wo;
  wo.url = server.url();
  wo.model_id = worker_model;
  wo.consumer = "w-a.sock";
  wo.stream_max_len = 50;
  auto worker = std::make_unique<moe::worker::WorkerRedisState>(wo, &backend);
  const auto first = worker->rewarm();
  CHECK(first.redis_reachable);
  CHECK(first.previous == 0);
  worker->start();

  // ---- the gateway: its client and its reader of the workers' streams.
  Loop loop;
  auto ep = pr::parse_redis_url(server.url());
  REQUIRE(ep.ok());
  auto client = std::make_unique<moe::gw::RedisClient>(&loop.loop, ep.value());
  moe::gw::RedisWorkerStreamsOptions so;
  so.model = gateway_model;
  so.poll_ms = 10;
  so.stream_max_len = 50;
  auto streams = std::make_unique<moe::gw::RedisWorkerStreams>(&loop.loop, client.get(), so);
  // The client goes first: replies still pending are answered (nullptr)
  // into the reader, which must still be there.
  struct Teardown {
    std::unique_ptr<moe::gw::RedisClient>& client;
    std::unique_ptr<moe::gw::RedisWorkerStreams>& streams;
    ~Teardown() {
      client.reset();
      streams.reset();
    }
  } teardown{client, streams};
  std::vector<std::pair<uint64_t, std::string>> routing;
  streams->on_routing(
      [&](uint64_t bucket, const std::string& layers) { routing.emplace_back(bucket, layers); });
  streams->start();
  client->start();
  CHECK(streams->resident_key() == worker->resident_key());
  CHECK(streams->routing_key() == worker->routing_key());
  CHECK(streams->events_key() == worker->events_key());

  // Worker → gateway: the resident set.
  auto resident_of = [&](const std::string& w) {
    auto it = streams->resident().find(w);
    return it == streams->resident().end() ? std::string("(none)") : it->second;
  };
  REQUIRE(loop.until([&] { return resident_of("w-a.sock") != "(none)"; }));
  CHECK(resident_of("w-a.sock") == "0:1 0:2 1:3");
  auto read_back = pr::parse_expert_list(resident_of("w-a.sock"));
  REQUIRE(read_back.ok());
  CHECK(read_back.value() == backend.resident());

  // Worker → gateway: a sequence's routing summary with its bucket.
  const uint64_t tag = (uint64_t(1) << 63) | (uint64_t(5) << 32) | 77;
  pr::StepRequest req;
  pr::StepSequence q;
  q.seq_id = 7;
  q.route_bucket = tag;
  req.sequences.push_back(q);
  pr::StepReply reply;
  pr::StepResult res;
  res.seq_id = 7;
  res.expert_usage = {0, 2, 0, 1, 3, 0, 0, 0};
  reply.results.push_back(res);
  worker->after_step(req, reply);
  worker->after_step(req, reply);  // a second step of the same sequence adds up
  worker->released(7);
  REQUIRE(loop.until([&] { return !routing.empty(); }));
  REQUIRE(routing.size() == 1);
  CHECK(routing[0].first == tag);
  CHECK(routing[0].second == "0:1=4,3=2 1:0=6");
  auto usage = pr::parse_routing_layers(routing[0].second, 2, 4);
  REQUIRE(usage.ok());
  CHECK(usage.value() == std::vector<float>{0, 4, 0, 2, 6, 0, 0, 0});

  // Gateway → worker: warm hints, applied on the worker's next step, after
  // which it publishes its new set as a change.
  REQUIRE(loop.until([&] { return raw.has_group(worker->events_key()); }));
  const std::vector<pr::ExpertRef> hints = {{1, 0}, {1, 2}};
  streams->publish_warm_hints(pr::format_expert_list(hints));
  REQUIRE(loop.until([&] {
    worker->after_step({}, {});
    return !backend.warmed.empty();
  }));
  CHECK(backend.warmed.back() == hints);
  REQUIRE(loop.until([&] { return resident_of("w-a.sock") == "0:1 0:2 1:0 1:2 1:3"; }));
  CHECK(loop.until([&] { return raw.pending(worker->events_key()) == 0; }));

  // Gateway → gateway (and the workers' events): a session, stored under
  // its key, read back by a store that has nothing in memory.
  moe::gw::SessionStoreOptions sso;
  sso.events_key = streams->events_key();
  sso.stream_max_len = 50;
  const moe::gw::SessionKey sk{moe::gw::SessionStore::open_owner(), "s-roundtrip"};
  const moe::gw::ChatMessages turns = {{"user", "hello"}, {"assistant", "hi there"}};
  {
    moe::gw::SessionStore writer(client.get(), sso);
    writer.save(sk, turns);
  }
  REQUIRE(loop.until([&] { return !raw.text({"GET", "moe:session:open:s-roundtrip"}).empty(); }));
  CHECK(raw.text({"GET", "moe:session:open:s-roundtrip"}) ==
        R"([{"content":"hello","role":"user"},{"content":"hi there","role":"assistant"}])");
  moe::gw::SessionStore reader(client.get(), sso);
  bool known = false;
  const moe::gw::ChatMessages back = load_session(loop, reader, sk, &known);
  REQUIRE(back.size() == 2);
  CHECK(back[1].content == "hi there");
  CHECK(known);
  // A key nothing is stored under is no session; one holding what is not a
  // list of turns is one (known), whose turns are not used.
  CHECK(load_session(loop, reader, {moe::gw::SessionStore::open_owner(), "s-never"}, &known).empty());
  CHECK_FALSE(known);
  raw.text({"SET", "moe:session:open:s-garbage", "[[[not turns"});
  CHECK(load_session(loop, reader, {moe::gw::SessionStore::open_owner(), "s-garbage"}, &known).empty());
  CHECK(known);
  // The worker acknowledges the session event too (it has no use for it).
  CHECK(loop.until([&] { return raw.pending(worker->events_key()) == 0; }));

  // ---- the raw bytes, as earlier releases wrote them.
  const auto resident = raw.entries("moe:demo-moe:resident");
  REQUIRE(resident.size() >= 2);
  CHECK(resident.front() ==
        pr::StreamFields{"worker", "w-a.sock", "kind", "snapshot", "experts", "0:1 0:2 1:3"});
  CHECK(resident.back() ==
        pr::StreamFields{"worker", "w-a.sock", "kind", "change", "experts", "0:1 0:2 1:0 1:2 1:3"});
  const auto routed = raw.entries("moe:demo-moe:routing");
  REQUIRE(routed.size() == 1);
  CHECK(routed[0] == pr::StreamFields{"worker", "w-a.sock", "seq", "7", "layers", "0:1=4,3=2 1:0=6",
                                      "bucket", std::to_string(tag)});
  const auto events = raw.entries("moe:demo-moe:events");
  REQUIRE(events.size() == 2);
  CHECK(events[0] == pr::StreamFields{"type", "warm", "experts", "1:0 1:2"});
  REQUIRE(events[1].size() == 6);
  CHECK(events[1][0] == "type");
  CHECK(events[1][1] == "session");
  CHECK(events[1][2] == "session");
  CHECK(events[1][3].size() == 16);
  CHECK(events[1][4] == "messages");
  CHECK(events[1][5] == "2");
  CHECK(raw.text({"TTL", "moe:session:open:s-roundtrip"}) != "-1");

  // ---- garbage the schema's decoder refuses is skipped, the last good set kept.
  const uint64_t skipped = streams->skipped();
  raw.text({"XADD", "moe:demo-moe:resident", "*", "worker", "w-a.sock", "experts", "banana"});
  raw.text({"XADD", "moe:demo-moe:resident", "*", "worker", "w-a.sock", "experts", "70000:1"});
  REQUIRE(loop.until([&] { return streams->skipped() == skipped + 2; }));
  CHECK(resident_of("w-a.sock") == "0:1 0:2 1:0 1:2 1:3");
  raw.text({"XADD", "moe:demo-moe:resident", "*", "worker", "w-a.sock", "kind", "change", "experts",
            "0:1 0:2 1:0 1:2 1:3"});  // the newest entry is a good one again, for the re-warm below

  // ---- a restarted worker re-warms from what the first one published.
  worker.reset();
  FakeBackend fresh(worker_model, {});
  moe::worker::WorkerRedisOptions wo2 = wo;
  wo2.consumer = "w-b.sock";
  moe::worker::WorkerRedisState restarted(wo2, &fresh);
  const auto rw = restarted.rewarm();
  CHECK(rw.redis_reachable);
  CHECK(rw.previous == 5);
  REQUIRE(fresh.warmed.size() == 1);
  CHECK(fresh.warmed[0] == std::vector<pr::ExpertRef>{{0, 1}, {0, 2}, {1, 0}, {1, 2}, {1, 3}});
}

TEST_CASE("a session's turns that Redis refuses stay the conversation; what is stored always loads back",
          "[redis][roundtrip][sessions]") {
  if (!have_redis_server()) return;
  RedisServer server;
  RawRedis raw(server.port);
  REQUIRE(raw.ok());
  Loop loop;
  auto ep = pr::parse_redis_url(server.url());
  REQUIRE(ep.ok());
  auto client = std::make_unique<moe::gw::RedisClient>(&loop.loop, ep.value());
  client->start();
  REQUIRE(loop.until([&] { return client->connected(); }));
  moe::gw::SessionStoreOptions sso;
  const moe::gw::SessionKey sk{moe::gw::SessionStore::open_owner(), "s-refused"};
  const std::string key = "moe:session:open:s-refused";
  auto load = [&](moe::gw::SessionStore& store) { return load_session(loop, store, sk); };
  auto save = [&](moe::gw::SessionStore& store, moe::gw::ChatMessages m) {
    bool done = false;
    store.save(sk, std::move(m), [&] { done = true; });
    REQUIRE(loop.until([&] { return done; }));
  };
  moe::gw::SessionStore store(client.get(), sso);
  const moe::gw::ChatMessages one = {{"user", "turn 1"}, {"assistant", "answer 1"}};
  moe::gw::ChatMessages two = one;
  two.push_back({"user", "turn 2"});
  two.push_back({"assistant", "answer 2"});
  save(store, one);
  CHECK(store.save_failures() == 0);
  // Redis full (noeviction): the save is refused with an error reply.
  REQUIRE(raw.text({"CONFIG", "SET", "maxmemory-policy", "noeviction"}) == "OK");
  REQUIRE(raw.text({"CONFIG", "SET", "maxmemory", "1"}) == "OK");
  save(store, two);
  CHECK(store.save_failures() == 1);
  CHECK(raw.text({"GET", key}).find("turn 2") == std::string::npos);  // Redis kept the older copy
  // The next turn sees turn 2: the refused save is the newer copy (Redis'
  // older one used to win, and the answered turn was lost).
  auto back = load(store);
  REQUIRE(back.size() == 4);
  CHECK(back[2].content == "turn 2");
  // Once Redis takes writes again, the next save stores the whole conversation.
  REQUIRE(raw.text({"CONFIG", "SET", "maxmemory", "0"}) == "OK");
  back.push_back({"user", "turn 3"});
  back.push_back({"assistant", "answer 3"});
  save(store, back);
  moe::gw::SessionStore fresh(client.get(), sso);  // another gateway: nothing in memory
  auto again = load(fresh);
  REQUIRE(again.size() == 6);
  CHECK(again[2].content == "turn 2");
  CHECK(again[4].content == "turn 3");

  // A keyed turn keeps the response that carried it (id, time, usage), so a
  // retry on any gateway gets that response again unchanged.
  {
    auto keyed = again;
    moe::gw::ChatMessage a{"assistant", "answer 4"};
    a.request_key = "key-4";
    a.request_digest = std::string(32, 'e');
    a.finish_reason = "length";
    a.response_id = "chatcmpl-0123456789abcdef";
    a.created = 1765000000;
    a.usage = R"({"completion_tokens":3,"prompt_tokens":5,"prompt_tokens_details":{"cached_tokens":2},"total_tokens":8})";
    keyed.push_back({"user", "turn 4"});
    keyed.push_back(a);
    save(store, keyed);
    moe::gw::SessionStore reader(client.get(), sso);
    const auto got = load(reader);
    REQUIRE(got.size() == 8);
    CHECK(got.back() == a);
    // A stored usage that is not counts is a copy load() refuses.
    std::string text = raw.text({"GET", key});
    const size_t at = text.find("\"total_tokens\":8");
    REQUIRE(at != std::string::npos);
    text.replace(at, 16, "\"total_tokens\":\"8\"");
    REQUIRE(raw.text({"SET", key, text}) == "OK");
    moe::gw::SessionStore doubter(client.get(), sso);
    CHECK(load(doubter).empty());
    save(store, again);
  }

  // Text of control bytes (escaped sixfold) and keyed turns' request fields
  // are not counted by the text cap: what save() writes must still be what
  // load() accepts, never a copy it refuses and a history lost.
  moe::gw::SessionStoreOptions small;
  small.max_bytes = 600;
  small.max_messages = 64;
  moe::gw::SessionStore tight(client.get(), small);
  moe::gw::ChatMessages many;
  for (int i = 0; i < 60; ++i) {  // 540 bytes of text; ~16 KB as JSON, over the 11.8 KB load() accepts
    moe::gw::ChatMessage m{i % 2 ? "assistant" : "user", i % 2 ? std::string() : std::string(18, '\x01'), "", ""};
    if (i % 2) {
      m.request_key = std::string(124, '"');
      m.request_digest = std::string(32, 'd');
      m.finish_reason = "length";
    }
    many.push_back(std::move(m));
  }
  save(tight, many);
  CHECK(raw.text({"GET", key}).size() <= 6 * small.max_bytes + 64 * small.max_messages + 4096);
  moe::gw::SessionStore tight_reader(client.get(), small);
  const auto kept = load(tight_reader);
  CHECK(kept.size() >= 2);  // the newest turns, not an empty history
  CHECK(kept.back().finish_reason == "length");
  client.reset();
}
