#pragma once
// HTTP/1.1 server on a libuv loop: keep-alive, one request at a time per
// connection (pipelined requests wait their turn), Content-Length bodies,
// header/body size limits, an idle (keep-alive) timeout and a deadline for a
// request that started but never finished (408), and streamed responses with
// chunked transfer coding whose write queue is bounded: a client that reads
// too slowly is dropped, exactly like one that disconnects.
//
// What a client can hold: at most max_connections connections (more are
// answered 503 and closed, a few at a time, the rest closed at once), each
// with at most one request's bytes waiting behind the one being answered
// (past that the connection stops keeping input, closes after the current
// response, and goes on reading only to notice the client leaving), and no
// write that makes no progress for write_timeout_ms (then it is closed).
// An exception escaping the handler is answered 500; none ends the process.
//
// Threading: everything runs on the loop thread given to the constructor.

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <uv.h>

#include "gateway/http/http_parser.h"
#include "model/result.h"

namespace moe::gw {

using HttpHeaders = std::vector<std::pair<std::string, std::string>>;

struct HttpServerOptions {
  std::string host = "127.0.0.1";
  int port = 8080;  // 0: an ephemeral port (see HttpServer::port())
  HttpLimits limits;
  uint64_t request_timeout_ms = 30'000;    // a started request must be whole by then → 408
  uint64_t keepalive_timeout_ms = 60'000;  // an idle connection is closed after this
  size_t max_write_queue_bytes = 1 << 20;  // a stream further behind than this is dropped
  size_t max_connections = 1024;           // open connections; past it 503 and close
  uint64_t write_timeout_ms = 30'000;      // a write not done by then closes the connection
  // A streamed response silent this long gets `stream_ping` as a chunk (an
  // SSE comment, which clients skip): proxies and clients that time out an
  // idle connection keep it while the work waits (a worker restarting).
  // 0 or empty: none.
  uint64_t stream_ping_ms = 15'000;
  std::string stream_ping = ": keep-alive\n\n";
};

struct HttpResponse {
  int status = 200;
  HttpHeaders headers;  // Content-Length, Connection and Server are added
  std::string body;
};

const char* http_reason(int status);

class Connection;

// One request and its response. The handler may answer at once or later (a
// stream). It holds a shared_ptr while it works; the connection detaches the
// exchange when the client goes away.
class HttpExchange {
 public:
  const HttpRequest& request() const { return req_; }

  // True while the client is connected and the response has not ended.
  bool open() const { return conn_ != nullptr && !ended_; }

  // A complete response; ends the exchange.
  void respond(HttpResponse r);

  // Starts a streamed response (chunked transfer coding; close-delimited for
  // HTTP/1.0 clients). Then send() any number of times and end().
  void begin_stream(int status, HttpHeaders headers);
  // Queues bytes of the stream. False when the client is gone, including
  // when it fell more than max_write_queue_bytes behind and was dropped.
  bool send(std::string_view data);
  void end();

  // Called once if the client goes away (disconnect, write error, dropped
  // for reading too slowly, server shutdown) before the response ended.
  void on_abort(std::function<void()> fn) { on_abort_ = std::move(fn); }

  // Keeps `state` alive until the exchange is over. It is released from a
  // libuv callback, never from inside one of the calls above, so a state
  // object may end its own exchange from its own methods.
  void keep(std::shared_ptr<void> state) { state_ = std::move(state); }

 private:
  friend class Connection;
  HttpRequest req_;
  Connection* conn_ = nullptr;
  bool streaming_ = false;
  bool chunked_ = false;
  bool ended_ = false;
  std::function<void()> on_abort_;
  std::shared_ptr<void> state_;
};

class HttpHandler {
 public:
  virtual ~HttpHandler() = default;
  // A complete, well-formed request. Answer through `ex` now or later.
  virtual void handle(const std::shared_ptr<HttpExchange>& ex) = 0;
  // The response for a request the server refused itself (malformed, too
  // large, timed out); the server adds "Connection: close".
  virtual HttpResponse protocol_error(int status, const std::string& message) = 0;
};

class HttpServer {
 public:
  HttpServer(uv_loop_t* loop, HttpServerOptions opts, HttpHandler* handler);
  ~HttpServer();
  HttpServer(const HttpServer&) = delete;
  HttpServer& operator=(const HttpServer&) = delete;

  // Binds and listens.
  Status listen();
  // The bound port (after listen()).
  int port() const { return bound_port_; }
  uv_loop_t* loop() const { return loop_; }
  // Stops listening and closes every connection (aborting their exchanges).
  // The loop must run on for the handles to finish closing.
  void close();

  // Open connections, those being refused (503) not counted.
  size_t connection_count() const { return connections_.size() - refusing_; }
  uint64_t refused_connections() const { return refused_; }

 private:
  friend class Connection;
  static void on_connection(uv_stream_t* server, int status);

  uv_loop_t* loop_;
  HttpServerOptions opts_;
  HttpHandler* handler_;
  uv_tcp_t listener_{};
  bool listening_ = false;
  bool closed_ = false;
  int bound_port_ = 0;
  std::vector<Connection*> connections_;
  size_t refusing_ = 0;  // of connections_, those being answered 503
  uint64_t refused_ = 0;
  std::vector<char> read_buf_;  // one read at a time on the loop thread
};

}  // namespace moe::gw
