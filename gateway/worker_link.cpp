#include "gateway/worker_link.h"

#include <cstdio>
#include <cstring>
#include <memory>

namespace moe::gw {

namespace pr = moe::protocol;

namespace {

// A handle whose owner may be gone by the time libuv calls back: the owner
// clears `data` and closes it; the close callback frees it.
template <typename H>
void close_and_free(H* h) {
  if (!h) return;
  h->data = nullptr;
  auto* base = reinterpret_cast<uv_handle_t*>(h);
  if (!uv_is_closing(base)) uv_close(base, [](uv_handle_t* x) { delete reinterpret_cast<H*>(x); });
}

struct WriteReq {
  uv_write_t req;
  std::vector<uint8_t> bytes;
};

}  // namespace

WorkerLink::WorkerLink(uv_loop_t* loop, WorkerLinkOptions opts, Callbacks cb)
    : loop_(loop), opts_(std::move(opts)), cb_(std::move(cb)), decoder_(opts_.max_frame_bytes) {
  timer_ = new uv_timer_t;
  uv_timer_init(loop_, timer_);
  timer_->data = this;
  retry_ms_ = opts_.retry_min_ms;
}

WorkerLink::~WorkerLink() {
  close_and_free(pipe_);
  close_and_free(timer_);
}

void WorkerLink::start() {
  if (state_ == State::idle && !pipe_) connect_now();
}

void WorkerLink::connect_now() {
  pipe_ = new uv_pipe_t;
  uv_pipe_init(loop_, pipe_, 0);
  pipe_->data = this;
  decoder_ = pr::FrameDecoder(opts_.max_frame_bytes);
  state_ = State::connecting;
  auto* req = new uv_connect_t;
  uv_pipe_connect(req, pipe_, opts_.socket_path.c_str(), &WorkerLink::on_connect);
}

void WorkerLink::on_connect(uv_connect_t* req, int status) {
  auto* pipe = reinterpret_cast<uv_pipe_t*>(req->handle);
  delete req;
  auto* self = pipe ? static_cast<WorkerLink*>(pipe->data) : nullptr;
  if (!self || self->pipe_ != pipe) return;  // closed meanwhile
  if (status < 0) {
    self->drop(std::string("connect: ") + uv_strerror(status));
    return;
  }
  self->state_ = State::handshaking;
  uv_read_start(reinterpret_cast<uv_stream_t*>(pipe), &WorkerLink::on_alloc, &WorkerLink::on_read);
  pr::Hello h;
  h.role = pr::Role::gateway;
  h.instance = self->opts_.instance;
  self->hello_request_id_ = self->next_request_id_++;
  if (auto st = self->write_frame(pr::make_frame(self->hello_request_id_, h).value()); !st.ok()) {
    self->drop(st.error());
    return;
  }
  self->last_rx_ms_ = self->now_ms();
  self->ping_outstanding_since_ms_ = 0;
  uv_timer_start(self->timer_, &WorkerLink::on_timer, self->opts_.heartbeat_ms, self->opts_.heartbeat_ms);
}

void WorkerLink::drop(const std::string& reason) {
  const bool was_ready = state_ == State::ready;
  close_and_free(pipe_);
  pipe_ = nullptr;
  state_ = State::idle;
  uv_timer_stop(timer_);
  schedule_retry();
  if (was_ready) {
    std::fprintf(stderr, "moe-gateway: worker %s down: %s\n", opts_.socket_path.c_str(), reason.c_str());
    if (cb_.on_down) cb_.on_down(reason);  // may destroy nothing: the link outlives its callbacks
  }
}

void WorkerLink::schedule_retry() {
  uv_timer_start(timer_, &WorkerLink::on_timer, retry_ms_, 0);
  retry_ms_ = std::min(opts_.retry_max_ms, std::max<uint64_t>(retry_ms_ * 2, 1));
}

void WorkerLink::on_timer(uv_timer_t* t) {
  auto* self = static_cast<WorkerLink*>(t->data);
  if (!self) return;
  if (self->state_ == State::idle) {
    self->connect_now();
    return;
  }
  const uint64_t now = self->now_ms();
  if (self->ping_outstanding_since_ms_ && now - self->last_rx_ms_ >= self->opts_.dead_after_ms) {
    self->drop("no answer within " + std::to_string(self->opts_.dead_after_ms) + " ms");
    return;
  }
  if (self->state_ == State::ready && !self->ping_outstanding_since_ms_) {
    self->ping_outstanding_since_ms_ = now;
    pr::Ping p;
    p.sent_us = now * 1000;
    (void)self->write_frame(pr::make_frame(self->next_request_id_++, p).value());
  } else if (self->state_ == State::handshaking && now - self->last_rx_ms_ >= self->opts_.dead_after_ms) {
    self->drop("no hello within " + std::to_string(self->opts_.dead_after_ms) + " ms");
  }
}

void WorkerLink::on_alloc(uv_handle_t*, size_t suggested, uv_buf_t* buf) {
  buf->base = new char[suggested];
  buf->len = suggested;
}

void WorkerLink::on_read(uv_stream_t* s, ssize_t n, const uv_buf_t* buf) {
  std::unique_ptr<char[]> owned(buf->base);
  auto* self = static_cast<WorkerLink*>(s->data);
  if (!self) return;
  if (n < 0) {
    self->drop(n == UV_EOF ? "the worker closed the connection" : std::string("read: ") + uv_strerror(int(n)));
    return;
  }
  if (n == 0) return;
  self->last_rx_ms_ = self->now_ms();
  self->decoder_.feed(std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(buf->base), size_t(n)));
  const uv_pipe_t* pipe = self->pipe_;
  while (self->pipe_ == pipe && pipe) {
    pr::DecodeEvent ev = self->decoder_.next();
    if (ev.status == pr::DecodeStatus::need_more) break;
    if (ev.status == pr::DecodeStatus::error) {
      if (ev.error.fatal) {
        self->drop("bad frame from the worker: " + ev.error.message);
        return;
      }
      std::fprintf(stderr, "moe-gateway: worker sent an unknown command: %s\n", ev.error.message.c_str());
      continue;
    }
    self->handle(ev.frame);
  }
}

void WorkerLink::handle(const pr::Frame& f) {
  const auto cmd = pr::Command(f.command);
  if (state_ == State::handshaking) {
    if (cmd == pr::Command::hello && f.request_id == hello_request_id_) {
      auto h = pr::decode_hello(f.payload);
      if (!h.ok()) {
        drop("bad hello from the worker: " + h.error());
        return;
      }
      if (auto st = pr::check_version(*h); !st.ok()) {
        std::fprintf(stderr, "moe-gateway: worker %s refused: %s\n", opts_.socket_path.c_str(), st.error().c_str());
        drop(st.error());
        return;
      }
      hello_ = std::move(h.value());
      state_ = State::ready;
      retry_ms_ = opts_.retry_min_ms;
      if (cb_.on_ready) cb_.on_ready(hello_);
      return;
    }
    if (cmd == pr::Command::error) {
      auto e = pr::decode_error(f.payload);
      drop("the worker refused hello: " + (e.ok() ? e->message : e.error()));
    }
    return;
  }
  if (cmd == pr::Command::pong) {
    ping_outstanding_since_ms_ = 0;
    return;
  }
  if (cmd == pr::Command::ping) {
    auto p = pr::decode_ping(f.payload);
    pr::Pong pong;
    pong.ping_sent_us = p.ok() ? p->sent_us : 0;
    pong.sent_us = now_ms() * 1000;
    (void)write_frame(pr::make_frame(f.request_id, pong).value());
    return;
  }
  // Any frame proves the worker alive, even while a long step keeps it from pinging back.
  ping_outstanding_since_ms_ = 0;
  if (cb_.on_frame) cb_.on_frame(f);
}

Status WorkerLink::write_frame(std::vector<uint8_t> bytes) {
  if (!pipe_) return make_error("not connected");
  auto* w = new WriteReq;
  w->bytes = std::move(bytes);
  uv_buf_t buf = uv_buf_init(reinterpret_cast<char*>(w->bytes.data()), unsigned(w->bytes.size()));
  const int rc = uv_write(&w->req, reinterpret_cast<uv_stream_t*>(pipe_), &buf, 1, [](uv_write_t* req, int status) {
    auto* wr = reinterpret_cast<WriteReq*>(req);
    auto* self = req->handle ? static_cast<WorkerLink*>(req->handle->data) : nullptr;
    delete wr;
    if (status < 0 && self && status != UV_ECANCELED) self->drop(std::string("write: ") + uv_strerror(status));
  });
  if (rc < 0) {
    delete w;
    return make_error(std::string("write: ") + uv_strerror(rc));
  }
  return {};
}

Result<uint64_t> WorkerLink::send(const pr::Message& m) {
  if (state_ != State::ready) return make_error("the worker is not ready");
  const uint64_t id = next_request_id_++;
  auto frame = pr::make_frame(id, m, opts_.max_frame_bytes);
  if (!frame.ok()) return make_error(frame.error());
  if (auto st = write_frame(std::move(frame.value())); !st.ok()) return make_error(st.error());
  return id;
}

}  // namespace moe::gw
