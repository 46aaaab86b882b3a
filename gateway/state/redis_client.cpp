#include "gateway/state/redis_client.h"

#include <hiredis/adapters/libuv.h>
#include <hiredis/async.h>
#include <hiredis/hiredis.h>

#include "gateway/last_resort.h"

#include <algorithm>
#include <charconv>
#include <cstdio>

namespace moe::gw {
namespace {

constexpr uint64_t kConnectTimeoutMs = 1000;
constexpr uint64_t kPingEveryMs = 1000;
constexpr uint64_t kPingTimeoutMs = 3000;

}  // namespace

RedisClient::RedisClient(uv_loop_t* loop, RedisEndpoint ep, uint64_t retry_max_ms)
    : loop_(loop), ep_(std::move(ep)), retry_max_ms_(retry_max_ms) {
  timer_ = new uv_timer_t;
  uv_timer_init(loop_, timer_);
  timer_->data = this;
  ping_timer_ = new uv_timer_t;
  uv_timer_init(loop_, ping_timer_);
  ping_timer_->data = this;
}

RedisClient::~RedisClient() {
  closing_ = true;
  if (ac_) {
    ac_->data = nullptr;
    redisAsyncFree(ac_);  // pending callbacks get nullptr now
    ac_ = nullptr;
  }
  for (uv_timer_t* t : {timer_, ping_timer_})
    uv_close(reinterpret_cast<uv_handle_t*>(t), [](uv_handle_t* h) { delete reinterpret_cast<uv_timer_t*>(h); });
}

void RedisClient::start() {
  connect_now();
  uv_timer_start(
      ping_timer_,
      [](uv_timer_t* t) {
        auto* self = static_cast<RedisClient*>(t->data);
        last_resort("a Redis heartbeat", [self] { self->heartbeat(); });
      },
      kPingEveryMs, kPingEveryMs);
}

void RedisClient::heartbeat() {
  if (!connected_ || !ac_) {
    ping_sent_ms_ = 0;
    return;
  }
  const uint64_t now = uv_now(loop_);
  if (ping_sent_ms_ == 0) {
    ping_sent_ms_ = now;
    command({"PING"}, [this](const redisReply*) { ping_sent_ms_ = 0; });
    return;
  }
  if (now - ping_sent_ms_ < kPingTimeoutMs) return;
  // No answer: the connection is dead without having said so. Its pending
  // commands fail now (nullptr replies; a command issued from one of those
  // callbacks sees the client disconnected), and reconnecting starts.
  redisAsyncContext* ac = ac_;
  ac_ = nullptr;
  connected_ = false;
  ping_sent_ms_ = 0;
  ac->data = nullptr;  // no disconnect callback from the free
  redisAsyncFree(ac);
  lost("no answer to PING for 3 s");
}

void RedisClient::connect_now() {
  if (closing_ || ac_) return;
  redisAsyncContext* ac = redisAsyncConnect(ep_.host.c_str(), ep_.port);
  if (!ac || ac->err) {
    if (ac) redisAsyncFree(ac);
    lost("cannot create a connection");
    return;
  }
  if (redisLibuvAttach(ac, loop_) != REDIS_OK) {
    redisAsyncFree(ac);
    lost("cannot attach to the loop");
    return;
  }
  ac->data = this;
  redisAsyncSetConnectCallback(ac, &RedisClient::on_connect);
  redisAsyncSetDisconnectCallback(ac, &RedisClient::on_disconnect);
  ac_ = ac;
  // A refused connection can end as a poll error the adapter does not pass
  // on to hiredis, and a Redis can accept and then never answer AUTH: give
  // up on this attempt after a while ourselves (ready() stops the timer).
  uv_timer_start(
      timer_,
      [](uv_timer_t* t) {
        auto* self = static_cast<RedisClient*>(t->data);
        last_resort("a Redis connection timeout", [self] {
          if (!self->ac_ || self->connected_) return;
          self->ac_->data = nullptr;
          redisAsyncFree(self->ac_);
          self->ac_ = nullptr;
          self->lost("connection attempt timed out");
        });
      },
      kConnectTimeoutMs, 0);
}

void RedisClient::on_connect(const redisAsyncContext* ac, int status) {
  auto* self = static_cast<RedisClient*>(ac->data);
  if (!self) return;
  last_resort("a Redis connection", [&] { self->connected(ac, status); });
}

void RedisClient::connected(const redisAsyncContext* ac, int status) {
  RedisClient* self = this;
  if (status != REDIS_OK) {
    // hiredis frees the context after this callback.
    self->ac_ = nullptr;
    self->lost(ac->errstr);
    return;
  }
  if (!self->ep_.auth()) return self->ready();
  // Logged in before anything else is sent; until then commands fail at
  // once, as while disconnected.
  std::vector<std::string> auth = {"AUTH"};
  if (!self->ep_.user.empty()) auth.push_back(self->ep_.user);
  auth.push_back(self->ep_.password);
  std::vector<const char*> argv;
  std::vector<size_t> lens;
  for (const auto& a : auth) {
    argv.push_back(a.data());
    lens.push_back(a.size());
  }
  auto* fn = new ReplyFn([self](const redisReply* r) {
    if (r && r->type == REDIS_REPLY_STATUS) return self->ready();
    if (!r) return;  // the connection went meanwhile: on_disconnect says so and retries
    const std::string why = r->type == REDIS_REPLY_ERROR ? std::string(r->str, r->len) : "an unexpected reply";
    if (!self->auth_refused_logged_)
      std::fprintf(stderr, "moe-gateway: Redis at %s refused the credentials: %s (retrying)\n",
                   self->ep_.where().c_str(), why.c_str());
    self->auth_refused_logged_ = true;
    self->down_logged_ = true;  // said already
    if (!self->ac_) return;
    redisAsyncContext* ac = self->ac_;
    self->ac_ = nullptr;
    ac->data = nullptr;
    redisAsyncFree(ac);
    self->lost("AUTH refused");
  });
  if (redisAsyncCommandArgv(self->ac_, &RedisClient::on_reply, fn, int(argv.size()), argv.data(), lens.data()) !=
      REDIS_OK) {
    delete fn;
    redisAsyncContext* c = self->ac_;
    self->ac_ = nullptr;
    c->data = nullptr;
    redisAsyncFree(c);
    self->lost("cannot send AUTH");
  }
}

void RedisClient::ready() {
  uv_timer_stop(timer_);
  connected_ = true;
  auth_refused_logged_ = false;
  retry_ms_ = 0;
  if (ever_connected_) ++reconnects_;
  std::fprintf(stderr, "moe-gateway: Redis at %s connected%s%s\n", ep_.where().c_str(), ep_.auth() ? " and logged in" : "",
               ever_connected_ ? " again" : "");
  ever_connected_ = true;
  down_logged_ = false;
  if (ep_.db != 0) command({"SELECT", std::to_string(ep_.db)}, [](const redisReply*) {});
  if (on_connected_) on_connected_();
}

void RedisClient::on_disconnect(const redisAsyncContext* ac, int status) {
  auto* self = static_cast<RedisClient*>(ac->data);
  if (!self) return;
  // hiredis frees the context after this callback.
  self->ac_ = nullptr;
  self->connected_ = false;
  self->ping_sent_ms_ = 0;
  self->lost(status == REDIS_OK ? "closed" : ac->errstr);
}

void RedisClient::lost(const char* why) {
  connected_ = false;
  if (closing_) return;
  if (!down_logged_) {
    std::fprintf(
        stderr,
        "moe-gateway: Redis at %s unreachable (%s); sessions and state stay in this process, "
        "reconnecting\n",
        ep_.where().c_str(), why ? why : "?");
    down_logged_ = true;
  }
  schedule_retry();
}

void RedisClient::schedule_retry() {
  retry_ms_ = std::clamp<uint64_t>(retry_ms_ * 2, 50, retry_max_ms_);
  uv_timer_start(
      timer_,
      [](uv_timer_t* t) {
        auto* self = static_cast<RedisClient*>(t->data);
        last_resort("a Redis reconnection", [self] { self->connect_now(); });
      },
      retry_ms_, 0);
}

void RedisClient::command(const std::vector<std::string>& args, ReplyFn done) {
  if (!connected_ || !ac_) {
    if (done) done(nullptr);
    return;
  }
  std::vector<const char*> argv;
  std::vector<size_t> lens;
  for (const auto& a : args) {
    argv.push_back(a.data());
    lens.push_back(a.size());
  }
  auto* fn = new ReplyFn(std::move(done));
  if (redisAsyncCommandArgv(ac_, &RedisClient::on_reply, fn, int(argv.size()), argv.data(),
                            lens.data()) != REDIS_OK) {
    ReplyFn f = std::move(*fn);
    delete fn;
    if (f) f(nullptr);
  }
}

void RedisClient::flush() {
  if (connected_ && ac_) redisAsyncHandleWrite(ac_);  // may find the link gone: on_disconnect then
}

void RedisClient::on_reply(redisAsyncContext*, void* reply, void* priv) {
  auto* fn = static_cast<ReplyFn*>(priv);
  ReplyFn f = std::move(*fn);
  delete fn;
  if (f) last_resort("a Redis reply", [&] { f(static_cast<const redisReply*>(reply)); });
}

}  // namespace moe::gw
