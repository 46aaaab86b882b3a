#include "gateway/http/http_server.h"

#include <algorithm>
#include <cstdio>
#include <cstring>

#include "gateway/last_resort.h"

namespace moe::gw {

namespace {
// Connections answered 503 at the same time, at most.
constexpr size_t kMaxRefusing = 16;
}  // namespace

const char* http_reason(int status) {
  switch (status) {
    case 100: return "Continue";
    case 200: return "OK";
    case 400: return "Bad Request";
    case 401: return "Unauthorized";
    case 404: return "Not Found";
    case 405: return "Method Not Allowed";
    case 408: return "Request Timeout";
    case 411: return "Length Required";
    case 413: return "Content Too Large";
    case 417: return "Expectation Failed";
    case 429: return "Too Many Requests";
    case 431: return "Request Header Fields Too Large";
    case 500: return "Internal Server Error";
    case 501: return "Not Implemented";
    case 503: return "Service Unavailable";
    case 505: return "HTTP Version Not Supported";
    default: return "Unknown";
  }
}

// One accepted TCP connection. Owned by the server's list; deletes itself
// once both of its handles have closed.
class Connection {
 public:
  // `refusing`: a connection past the cap, answered 503 and closed.
  Connection(HttpServer* server, bool refusing)
      : server_(server), parser_(server->opts_.limits), refusing_(refusing) {
    tcp_.data = this;
    timer_.data = this;
    write_timer_.data = this;
  }

  bool start(uv_stream_t* listener) {
    uv_tcp_init(server_->loop_, &tcp_);
    uv_timer_init(server_->loop_, &timer_);
    uv_timer_init(server_->loop_, &write_timer_);
    tcp_.data = this;
    timer_.data = this;
    write_timer_.data = this;
    handles_open_ = 3;
    if (uv_accept(listener, reinterpret_cast<uv_stream_t*>(&tcp_)) != 0) {
      close();
      return false;
    }
    uv_tcp_nodelay(&tcp_, 1);
    sockaddr_storage addr{};
    int len = sizeof(addr);
    char name[64] = "";
    if (uv_tcp_getpeername(&tcp_, reinterpret_cast<sockaddr*>(&addr), &len) == 0) {
      if (addr.ss_family == AF_INET6)
        uv_ip6_name(reinterpret_cast<sockaddr_in6*>(&addr), name, sizeof(name));
      else
        uv_ip4_name(reinterpret_cast<sockaddr_in*>(&addr), name, sizeof(name));
    }
    peer_ = name;
    if (refusing_) {
      send_protocol_error(503, "too many connections; retry shortly");
      return true;
    }
    arm_timer(server_->opts_.keepalive_timeout_ms);
    uv_read_start(stream(), alloc_cb, read_cb);
    reading_ = true;
    return true;
  }

  bool refusing() const { return refusing_; }

  // Ends the connection now; an unfinished exchange is aborted.
  void close() {
    if (closing_) return;
    closing_ = true;
    if (reading_) uv_read_stop(stream());
    reading_ = false;
    uv_timer_stop(&timer_);
    uv_timer_stop(&write_timer_);
    if (current_) {
      auto ex = current_;
      bool unfinished = !ex->ended_;
      ex->conn_ = nullptr;
      if (unfinished && ex->on_abort_) {
        auto fn = std::move(ex->on_abort_);
        last_resort("a client's abort", fn);
      }
    }
    uv_close(reinterpret_cast<uv_handle_t*>(&tcp_), close_cb);
    uv_close(reinterpret_cast<uv_handle_t*>(&timer_), close_cb);
    uv_close(reinterpret_cast<uv_handle_t*>(&write_timer_), close_cb);
  }

  // --- used by HttpExchange ---

  void write_head(HttpExchange* ex, int status, const HttpHeaders& headers, const std::string* body) {
    std::string out;
    out.reserve(256 + (body ? body->size() : 0));
    out += "HTTP/1.1 ";
    out += std::to_string(status);
    out += ' ';
    out += http_reason(status);
    out += "\r\nServer: moe-gateway\r\n";
    for (const auto& [k, v] : headers) {
      out += k;
      out += ": ";
      out += v;
      out += "\r\n";
    }
    if (body) {
      out += "Content-Length: " + std::to_string(body->size()) + "\r\n";
    } else if (ex->chunked_) {
      out += "Transfer-Encoding: chunked\r\n";
    }
    out += keep_alive_ ? "Connection: keep-alive\r\n\r\n" : "Connection: close\r\n\r\n";
    if (body && ex->req_.method != "HEAD") out += *body;  // a HEAD's answer: the length alone
    write(std::move(out), body != nullptr);
    if (!body) arm_ping();
  }

  bool write_stream(std::string_view data) {
    size_t queued = uv_stream_get_write_queue_size(stream());
    if (queued + data.size() > server_->opts_.max_write_queue_bytes) {
      close();  // the slow reader is treated as gone: its work is cancelled
      return false;
    }
    if (data.empty()) return true;
    if (current_ && current_->chunked_) {
      char len[24];
      int n = std::snprintf(len, sizeof(len), "%zx\r\n", data.size());
      std::string out;
      out.reserve(n + data.size() + 2);
      out.append(len, n);
      out.append(data);
      out += "\r\n";
      write(std::move(out), false);
    } else {
      write(std::string(data), false);
    }
    arm_ping();
    return !closing_;
  }

  // The stream's silence deadline (timer_ has no other use while an
  // exchange is current).
  void arm_ping() {
    if (!server_->opts_.stream_ping.empty()) arm_timer(server_->opts_.stream_ping_ms);
  }

  void end_stream() {
    uv_timer_stop(&timer_);
    if (current_ && current_->chunked_) {
      write("0\r\n\r\n", true);
    } else {
      keep_alive_ = false;
      write(std::string(), true);
    }
  }

  void set_keep_alive(bool on) { keep_alive_ = keep_alive_ && on; }

 private:
  struct WriteReq {
    uv_write_t req;
    std::string data;
    Connection* conn;
    bool last;  // the end of the current exchange's response
  };

  uv_stream_t* stream() { return reinterpret_cast<uv_stream_t*>(&tcp_); }

  void arm_timer(uint64_t ms) {
    uv_timer_stop(&timer_);
    if (ms > 0) uv_timer_start(&timer_, timer_cb, ms, 0);
  }

  void write(std::string data, bool last) {
    if (closing_) return;
    auto* w = new WriteReq{{}, std::move(data), this, last};
    w->req.data = w;
    uv_buf_t buf = uv_buf_init(w->data.data(), static_cast<unsigned>(w->data.size()));
    int rc = uv_write(&w->req, stream(), &buf, 1, write_cb);
    if (rc != 0) {
      delete w;
      close();
      return;
    }
    // Bytes the client has not taken yet: some must go within the write timeout.
    if (uv_stream_get_write_queue_size(stream()) > 0 &&
        !uv_is_active(reinterpret_cast<uv_handle_t*>(&write_timer_)))
      arm_write_timer();
  }

  void arm_write_timer() {
    queued_at_arm_ = uv_stream_get_write_queue_size(stream());
    uv_timer_start(&write_timer_, write_timer_cb, server_->opts_.write_timeout_ms, 0);
  }

  static void write_cb(uv_write_t* req, int status) {
    auto* w = static_cast<WriteReq*>(req->data);
    Connection* c = w->conn;
    bool last = w->last;
    delete w;
    last_resort("an HTTP write's completion", [&] {
      if (status < 0) {
        c->close();
        return;
      }
      // Progress: the deadline starts again for what is still queued, if anything.
      if (!c->closing_) {
        uv_timer_stop(&c->write_timer_);
        if (uv_stream_get_write_queue_size(c->stream()) > 0) c->arm_write_timer();
      }
      if (last && !c->closing_) c->finish_exchange();
    });
  }

  static void write_timer_cb(uv_timer_t* t) {
    auto* c = static_cast<Connection*>(t->data);
    if (c->closing_) return;
    // A client that took some bytes made progress (a big response goes out
    // in one write, whose completion comes only at its end).
    if (uv_stream_get_write_queue_size(c->stream()) < c->queued_at_arm_) {
      c->arm_write_timer();
      return;
    }
    // One that takes nothing keeps neither its connection nor its response.
    c->close();
  }

  // The response was written: release the exchange (and the handler's state),
  // then go on with the next pipelined request, or close.
  void finish_exchange() {
    if (current_) {
      current_->conn_ = nullptr;
      current_->state_.reset();
      current_->on_abort_ = nullptr;
      current_.reset();
    }
    if (!keep_alive_) {
      linger_close();
      return;
    }
    parser_.reset();
    request_timer_armed_ = false;
    arm_timer(server_->opts_.keepalive_timeout_ms);
    if (!reading_) {
      uv_read_start(stream(), alloc_cb, read_cb);
      reading_ = true;
    }
    process_input();
  }

  // Half-closes, then drains what the client still sends for a moment before
  // closing, so that an error response is not lost to a TCP reset.
  void linger_close() {
    lingering_ = true;
    inbuf_.clear();
    auto* req = new uv_shutdown_t;
    req->data = this;
    if (uv_shutdown(req, stream(), [](uv_shutdown_t* r, int) { delete r; }) != 0) {
      delete req;
      close();
      return;
    }
    if (!reading_) {
      uv_read_start(stream(), alloc_cb, read_cb);
      reading_ = true;
    }
    arm_timer(std::min<uint64_t>(1000, server_->opts_.request_timeout_ms));
  }

  static void alloc_cb(uv_handle_t* h, size_t, uv_buf_t* buf) {
    auto* c = static_cast<Connection*>(h->data);
    auto& rb = c->server_->read_buf_;
    *buf = uv_buf_init(rb.data(), static_cast<unsigned>(rb.size()));
  }

  static void read_cb(uv_stream_t* s, ssize_t nread, const uv_buf_t* buf) {
    auto* c = static_cast<Connection*>(s->data);
    if (!last_resort("an HTTP read", [&] { c->on_read(nread, buf); }) && !c->closing_) c->fail_exchange();
  }

  void on_read(ssize_t nread, const uv_buf_t* buf) {
    if (nread == 0) return;
    if (nread < 0) {
      // EOF or error: the client is gone (or half-closed, which HTTP clients
      // do not do mid-request); its work is cancelled at once.
      close();
      return;
    }
    if (lingering_ || discarding_) return;
    inbuf_.append(buf->base, static_cast<size_t>(nread));
    if (current_) {
      // Busy with a request: hold pipelined bytes, but not without bound.
      // Past one whole request's worth the input is no longer kept: the
      // connection closes after this response, and reading goes on only so
      // that a client who leaves is noticed (and its work cancelled).
      const auto& lim = server_->opts_.limits;
      if (inbuf_.size() > lim.max_header_bytes + lim.max_body_bytes) {
        inbuf_.clear();
        inbuf_.shrink_to_fit();
        discarding_ = true;
        keep_alive_ = false;
      }
      return;
    }
    process_input();
  }

  // An exception escaped the handler of the current request: answer it 500
  // if nothing was sent yet, end it otherwise, and close after.
  void fail_exchange() {
    keep_alive_ = false;
    auto ex = current_;
    // Already answered (or half-answered) when it threw: nothing can be
    // said any more; the connection goes.
    if (!ex || !ex->open()) return close();
    // Whatever the handler started (sequences in the scheduler) is stopped
    // first: its state is released with the exchange.
    if (ex->on_abort_) {
      auto fn = std::move(ex->on_abort_);
      last_resort("a failed request's abort", fn);
    }
    const bool answered = last_resort("an HTTP 500", [&] {
      if (!ex->open()) return;
      if (ex->streaming_) {
        ex->end();
      } else {
        ex->respond(server_->handler_->protocol_error(500, "internal error while handling the request"));
      }
    });
    if (!answered) close();
  }

  static void timer_cb(uv_timer_t* t) {
    auto* c = static_cast<Connection*>(t->data);
    if (c->closing_) return;
    if (c->lingering_ || c->current_) {
      if (c->lingering_) {
        c->close();
      } else if (c->current_->streaming_ && !c->current_->ended_) {
        c->write_stream(c->server_->opts_.stream_ping);  // re-arms
      }
      return;
    }
    if (c->parser_.started()) {
      if (!last_resort("an HTTP 408", [&] { c->send_protocol_error(408, "request not received in time"); })) c->close();
    } else {
      c->close();  // idle keep-alive connection
    }
  }

  static void close_cb(uv_handle_t* h) {
    auto* c = static_cast<Connection*>(h->data);
    if (--c->handles_open_ == 0) {
      if (c->refusing_) --c->server_->refusing_;
      auto& list = c->server_->connections_;
      list.erase(std::remove(list.begin(), list.end(), c), list.end());
      if (c->current_) {
        // Releasing the handler's state may run its destructor: nothing it
        // throws may reach libuv.
        last_resort("releasing a request's state", [&] {
          c->current_->state_.reset();
          c->current_->on_abort_ = nullptr;
        });
      }
      delete c;
    }
  }

  void send_protocol_error(int status, const std::string& message) {
    HttpResponse r = server_->handler_->protocol_error(status, message);
    if (status == 503) r.headers.emplace_back("Retry-After", "1");
    keep_alive_ = false;
    auto ex = std::make_shared<HttpExchange>();
    ex->conn_ = this;
    current_ = ex;
    ex->respond(std::move(r));
  }

  void process_input() {
    while (!closing_ && !lingering_ && !current_ && !inbuf_.empty()) {
      size_t used = parser_.feed(inbuf_);
      inbuf_.erase(0, used);
      switch (parser_.state()) {
        case HttpRequestParser::State::incomplete:
          break;
        case HttpRequestParser::State::headers_done:
          if (parser_.request().expect_continue) write("HTTP/1.1 100 Continue\r\n\r\n", false);
          continue;
        case HttpRequestParser::State::error:
          uv_timer_stop(&timer_);
          send_protocol_error(parser_.error_status(), parser_.error_message());
          return;
        case HttpRequestParser::State::complete: {
          uv_timer_stop(&timer_);
          auto ex = std::make_shared<HttpExchange>();
          ex->req_ = parser_.take_request();
          ex->req_.peer = peer_;
          ex->conn_ = this;
          keep_alive_ = ex->req_.keep_alive;
          current_ = ex;
          if (!last_resort("a request's handler", [&] { server_->handler_->handle(ex); }) && !closing_) fail_exchange();
          return;
        }
      }
      break;
    }
    if (!closing_ && !current_ && parser_.started() && !request_timer_armed_) {
      request_timer_armed_ = true;
      arm_timer(server_->opts_.request_timeout_ms);
    }
  }

  friend class HttpExchange;
  HttpServer* server_;
  uv_tcp_t tcp_{};
  uv_timer_t timer_{};        // keep-alive idle, request deadline, linger
  uv_timer_t write_timer_{};  // write progress deadline
  int handles_open_ = 0;
  std::string peer_;
  HttpRequestParser parser_;
  std::string inbuf_;  // received, not yet parsed (pipelined requests wait here)
  std::shared_ptr<HttpExchange> current_;
  bool keep_alive_ = true;
  bool closing_ = false;
  bool lingering_ = false;
  bool reading_ = false;
  bool request_timer_armed_ = false;
  bool discarding_ = false;  // pipelined input past the bound: no longer kept
  size_t queued_at_arm_ = 0;  // unsent bytes when the write deadline was armed
  bool refusing_ = false;
};

// --- HttpExchange ---

void HttpExchange::respond(HttpResponse r) {
  if (!open() || streaming_) return;
  ended_ = true;
  conn_->write_head(this, r.status, r.headers, &r.body);
}

void HttpExchange::begin_stream(int status, HttpHeaders headers) {
  if (!open() || streaming_) return;
  streaming_ = true;
  chunked_ = req_.version_minor >= 1;
  if (!chunked_) conn_->set_keep_alive(false);
  conn_->write_head(this, status, headers, nullptr);
}

bool HttpExchange::send(std::string_view data) {
  if (!open() || !streaming_) return false;
  return conn_->write_stream(data);
}

void HttpExchange::end() {
  if (!open() || !streaming_) return;
  ended_ = true;
  conn_->end_stream();
}

// --- HttpServer ---

HttpServer::HttpServer(uv_loop_t* loop, HttpServerOptions opts, HttpHandler* handler)
    : loop_(loop), opts_(std::move(opts)), handler_(handler), read_buf_(64 * 1024) {}

HttpServer::~HttpServer() = default;

Status HttpServer::listen() {
  sockaddr_storage addr{};
  int rc = uv_ip4_addr(opts_.host.c_str(), opts_.port, reinterpret_cast<sockaddr_in*>(&addr));
  if (rc != 0) rc = uv_ip6_addr(opts_.host.c_str(), opts_.port, reinterpret_cast<sockaddr_in6*>(&addr));
  if (rc != 0) return make_error("invalid listen address '" + opts_.host + "'");
  uv_tcp_init(loop_, &listener_);
  listener_.data = this;
  listening_ = true;
  rc = uv_tcp_bind(&listener_, reinterpret_cast<const sockaddr*>(&addr), 0);
  if (rc == 0) rc = uv_listen(reinterpret_cast<uv_stream_t*>(&listener_), 511, on_connection);
  if (rc != 0) {
    return make_error("cannot listen on " + opts_.host + ":" + std::to_string(opts_.port) + ": " +
                      uv_strerror(rc));
  }
  sockaddr_storage bound{};
  int len = sizeof(bound);
  uv_tcp_getsockname(&listener_, reinterpret_cast<sockaddr*>(&bound), &len);
  if (bound.ss_family == AF_INET) {
    bound_port_ = ntohs(reinterpret_cast<sockaddr_in*>(&bound)->sin_port);
  } else {
    bound_port_ = ntohs(reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port);
  }
  return {};
}

void HttpServer::on_connection(uv_stream_t* listener, int status) {
  auto* self = static_cast<HttpServer*>(listener->data);
  if (status < 0 || self->closed_) return;
  last_resort("accepting a connection", [&] {
    // Past the cap a few connections at a time are told 503; beyond those,
    // the connection is accepted and closed at once so the backlog drains.
    const bool over = self->connection_count() >= self->opts_.max_connections;
    if (over) {
      ++self->refused_;
      if (self->refused_ == 1 || self->refused_ % 1000 == 0)
        std::fprintf(stderr, "moe-gateway: %zu connections open, the limit; refusing new ones (%llu so far)\n",
                     self->connection_count(), static_cast<unsigned long long>(self->refused_));
    }
    if (over && self->refusing_ >= kMaxRefusing) {
      auto* t = new uv_tcp_t;
      uv_tcp_init(self->loop_, t);
      uv_accept(listener, reinterpret_cast<uv_stream_t*>(t));
      uv_close(reinterpret_cast<uv_handle_t*>(t), [](uv_handle_t* h) { delete reinterpret_cast<uv_tcp_t*>(h); });
      return;
    }
    auto* c = new Connection(self, over);
    if (over) ++self->refusing_;
    self->connections_.push_back(c);
    c->start(listener);
  });
}

void HttpServer::close() {
  if (closed_) return;
  closed_ = true;
  if (listening_) uv_close(reinterpret_cast<uv_handle_t*>(&listener_), nullptr);
  std::vector<Connection*> all = connections_;
  for (Connection* c : all) c->close();
}

}  // namespace moe::gw
