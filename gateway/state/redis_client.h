#pragma once
// An asynchronous Redis connection on the gateway's libuv loop (hiredis's
// async API through its libuv adapter): commands never block the loop. When
// Redis is not reachable, commands fail at once (their callback gets
// nullptr) and the client reconnects by itself with backoff; the log says
// "unreachable" once per outage and "connected" when it is back.
//
// Threading: loop thread only. Lifetime: destroy on the loop thread; the
// callbacks of commands still pending are called with nullptr first.

#include <uv.h>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "model/result.h"
#include "protocol/redis_endpoint.h"

struct redisAsyncContext;
struct redisReply;

namespace moe::gw {

using protocol::RedisEndpoint;

class RedisClient {
 public:
  // reply == nullptr: not connected, or the connection broke before the answer.
  using ReplyFn = std::function<void(const redisReply* reply)>;

  RedisClient(uv_loop_t* loop, RedisEndpoint ep, uint64_t retry_max_ms = 2000);
  ~RedisClient();
  RedisClient(const RedisClient&) = delete;
  RedisClient& operator=(const RedisClient&) = delete;

  // Connects (logging in first when the endpoint has a password; refused
  // credentials are logged and retried with backoff, never silently
  // ignored), and keeps reconnecting until destroyed. While connected it
  // sends a PING every second; one unanswered for 3 s ends the connection
  // (a Redis that froze, or died without the socket saying so), failing its
  // pending commands (nullptr replies) instead of leaving them waiting.
  void start();
  bool connected() const { return connected_; }
  uint64_t reconnects() const { return reconnects_; }
  // Called after every (re)connection.
  void on_connected(std::function<void()> fn) { on_connected_ = std::move(fn); }

  void command(const std::vector<std::string>& args, ReplyFn done);
  // Writes the queued commands to the socket now instead of on the loop's
  // next turn, so that what the caller acknowledges next (a session turn's
  // reply) is already on its way to Redis even if this process dies the
  // next instant (the kernel still delivers a killed process's sent bytes).
  void flush();

 private:
  static void on_connect(const redisAsyncContext* ac, int status);
  static void on_disconnect(const redisAsyncContext* ac, int status);
  static void on_reply(redisAsyncContext* ac, void* reply, void* priv);
  void connected(const redisAsyncContext* ac, int status);
  void ready();  // connected, and logged in
  void connect_now();
  void heartbeat();
  void lost(const char* why);
  void schedule_retry();

  uv_loop_t* loop_;
  RedisEndpoint ep_;
  uint64_t retry_max_ms_;
  uint64_t retry_ms_ = 0;
  redisAsyncContext* ac_ = nullptr;
  bool connected_ = false;
  bool down_logged_ = false;
  bool auth_refused_logged_ = false;
  bool ever_connected_ = false;
  bool closing_ = false;
  uint64_t reconnects_ = 0;
  uv_timer_t* timer_ = nullptr;
  uv_timer_t* ping_timer_ = nullptr;
  uint64_t ping_sent_ms_ = 0;  // loop time of the unanswered PING, 0: none
  std::function<void()> on_connected_;
};

}  // namespace moe::gw
