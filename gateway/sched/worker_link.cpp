#include "gateway/sched/worker_link.h"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <memory>

#include <poll.h>

#include "gateway/last_resort.h"

namespace moe::gw {

namespace pr = moe::protocol;

namespace {

// How long a worker may stay unreachable before the gateway says so.
constexpr uint64_t kUnreachableSayMs = 10000;

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

std::string id_list(std::vector<int32_t> ids) {
  std::sort(ids.begin(), ids.end());
  std::string s;
  for (int32_t id : ids) s += (s.empty() ? "" : " ") + std::to_string(id);
  return s.empty() ? "none" : s;
}

}  // namespace

Status check_vocabulary(const pr::Hello& h, const WorkerVocabulary& v) {
  if (v.vocab_size == 0) return {};
  std::vector<int32_t> want = v.eos_ids, got = h.eos_ids;
  std::sort(want.begin(), want.end());
  std::sort(got.begin(), got.end());
  if (h.vocab_size == v.vocab_size && got == want) return {};
  return make_error("its model " + (h.model_id.empty() ? std::string("(unnamed)") : "'" + h.model_id + "'") +
                    " has a vocabulary of " + std::to_string(h.vocab_size) + " token ids (EOS " + id_list(h.eos_ids) +
                    "), the gateway's model '" + v.model + "' one of " + std::to_string(v.vocab_size) + " (EOS " +
                    id_list(v.eos_ids) +
                    "): requests move between workers as token ids, so every worker, the fallback included, "
                    "must serve a model with the gateway's tokenizer");
}

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
  if (!last_resort("a worker connection", [&] { self->connected(status); }) && self->pipe_ == pipe)
    self->drop("internal error while connecting");
}

void WorkerLink::connected(int status) {
  if (status < 0) {
    drop(std::string("connect: ") + uv_strerror(status));
    return;
  }
  state_ = State::handshaking;
  uv_read_start(reinterpret_cast<uv_stream_t*>(pipe_), &WorkerLink::on_alloc, &WorkerLink::on_read);
  pr::Hello h;
  h.role = pr::Role::gateway;
  h.instance = opts_.instance;
  hello_request_id_ = next_request_id_++;
  if (auto st = write_frame(pr::make_frame(hello_request_id_, h).value()); !st.ok()) {
    drop(st.error());
    return;
  }
  last_rx_ms_ = now_ms();
  ping_outstanding_since_ms_ = 0;
  // Ticks four times per heartbeat: silence is judged to a quarter of it.
  const uint64_t tick = std::max<uint64_t>(opts_.heartbeat_ms / 4, 1);
  uv_timer_start(timer_, &WorkerLink::on_timer, tick, tick);
}

void WorkerLink::drop(const std::string& reason, bool unresponsive) {
  const bool was_ready = state_ == State::ready;
  last_failure_ = reason;
  close_and_free(pipe_);
  pipe_ = nullptr;
  state_ = State::idle;
  uv_timer_stop(timer_);
  schedule_retry();
  if (!was_ready && !unreachable_said_) {
    // Never reached (a wrong --worker path, a worker that is not running):
    // said once the streak is long, with what the last try met.
    const uint64_t now = now_ms();
    if (unreachable_since_ms_ == 0) unreachable_since_ms_ = now;
    if (now - unreachable_since_ms_ >= kUnreachableSayMs) {
      std::fprintf(stderr, "moe-gateway: worker %s not reachable for %llu s (%s); still trying\n",
                   opts_.socket_path.c_str(), static_cast<unsigned long long>((now - unreachable_since_ms_) / 1000),
                   reason.c_str());
      unreachable_said_ = true;
    }
  }
  if (was_ready) {
    std::fprintf(stderr, "moe-gateway: worker %s down: %s\n", opts_.socket_path.c_str(), reason.c_str());
    if (cb_.on_down) cb_.on_down(reason, unresponsive);  // may destroy nothing: the link outlives its callbacks
  }
}

void WorkerLink::schedule_retry() {
  uv_timer_start(timer_, &WorkerLink::on_timer, retry_ms_, 0);
  retry_ms_ = std::min(opts_.retry_max_ms, std::max<uint64_t>(retry_ms_ * 2, 1));
}

void WorkerLink::on_timer(uv_timer_t* t) {
  auto* self = static_cast<WorkerLink*>(t->data);
  if (!self) return;
  if (!last_resort("a worker link's timer", [self] { self->on_tick(); })) self->drop("internal error");
}

bool WorkerLink::bytes_waiting() const {
  uv_os_fd_t fd = -1;
  if (!pipe_ || uv_fileno(reinterpret_cast<const uv_handle_t*>(pipe_), &fd) != 0) return false;
  pollfd p{fd, POLLIN, 0};
  return ::poll(&p, 1, 0) > 0 && (p.revents & POLLIN);
}

void WorkerLink::on_tick() {
  if (state_ == State::idle) {
    connect_now();
    return;
  }
  const uint64_t now = now_ms();
  const bool silent = now - last_rx_ms_ >= opts_.dead_after_ms;
  if (silent && (ping_outstanding_since_ms_ || state_ == State::handshaking)) {
    // This loop may have been the slow one: the worker's bytes are there.
    if (bytes_waiting()) return;
    if (state_ == State::handshaking) {
      drop("no hello within " + std::to_string(opts_.dead_after_ms) + " ms", true);
    } else {
      drop("no answer within " + std::to_string(opts_.dead_after_ms) + " ms", true);
    }
    return;
  }
  if (state_ == State::ready && !ping_outstanding_since_ms_ && now - last_ping_ms_ >= opts_.heartbeat_ms) {
    ping_outstanding_since_ms_ = now;
    last_ping_ms_ = now;
    pr::Ping p;
    p.sent_us = now * 1000;
    (void)write_frame(pr::make_frame(next_request_id_++, p).value());
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
  // What a frame's handler throws (the scheduler, the observers behind it)
  // costs this connection, never the process.
  if (!last_resort("a worker's frame", [&] { self->on_read_bytes(n, buf); }) && self->pipe_)
    self->drop("internal error while handling the worker's frame");
}

void WorkerLink::on_read_bytes(ssize_t n, const uv_buf_t* buf) {
  if (n < 0) {
    drop(n == UV_EOF ? "the worker closed the connection" : std::string("read: ") + uv_strerror(int(n)));
    return;
  }
  if (n == 0) return;
  last_rx_ms_ = now_ms();
  decoder_.feed(std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(buf->base), size_t(n)));
  const uv_pipe_t* pipe = pipe_;
  while (pipe_ == pipe && pipe) {
    pr::DecodeEvent ev = decoder_.next();
    if (ev.status == pr::DecodeStatus::need_more) break;
    if (ev.status == pr::DecodeStatus::error) {
      if (ev.error.fatal) {
        drop("bad frame from the worker: " + ev.error.message);
        return;
      }
      std::fprintf(stderr, "moe-gateway: worker sent an unknown command: %s\n", ev.error.message.c_str());
      continue;
    }
    handle(ev.frame);
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
      if (auto st = check_vocabulary(*h, opts_.vocabulary); !st.ok()) {
        if (st.error() != refused_) {
          std::fprintf(stderr, "moe-gateway: worker %s refused: %s\n", opts_.socket_path.c_str(), st.error().c_str());
          refused_ = st.error();
        }
        drop(st.error());
        return;
      }
      refused_.clear();
      hello_ = std::move(h.value());
      state_ = State::ready;
      unreachable_since_ms_ = 0;
      unreachable_said_ = false;
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
  if (uv_stream_get_write_queue_size(reinterpret_cast<uv_stream_t*>(pipe_)) + bytes.size() > opts_.max_write_queue_bytes) {
    // A worker that reads nothing of this much is as good as gone.
    drop("the worker takes none of what is sent to it", true);
    return make_error("the worker is not reading");
  }
  auto* w = new WriteReq;
  w->bytes = std::move(bytes);
  uv_buf_t buf = uv_buf_init(reinterpret_cast<char*>(w->bytes.data()), unsigned(w->bytes.size()));
  const int rc = uv_write(&w->req, reinterpret_cast<uv_stream_t*>(pipe_), &buf, 1, [](uv_write_t* req, int status) {
    auto* wr = reinterpret_cast<WriteReq*>(req);
    auto* self = req->handle ? static_cast<WorkerLink*>(req->handle->data) : nullptr;
    delete wr;
    if (status < 0 && self && status != UV_ECANCELED)
      last_resort("a worker write's failure", [&] { self->drop(std::string("write: ") + uv_strerror(status)); });
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
