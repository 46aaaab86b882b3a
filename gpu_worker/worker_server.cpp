#include "gpu_worker/worker_server.h"

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <variant>

#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include "protocol/messages.h"

namespace moe::worker {

namespace pr = moe::protocol;
using pr::ErrorCode;

namespace {
uint64_t now_ms() {
  return uint64_t(std::chrono::duration_cast<std::chrono::milliseconds>(
                      std::chrono::steady_clock::now().time_since_epoch())
                      .count());
}
uint64_t now_us() {
  return uint64_t(std::chrono::duration_cast<std::chrono::microseconds>(
                      std::chrono::system_clock::now().time_since_epoch())
                      .count());
}
void set_nonblocking(int fd) { fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK); }
}  // namespace

WorkerServer::WorkerServer(Backend* backend, ServerOptions opts)
    : backend_(backend), opts_(std::move(opts)), decoder_(opts_.max_frame_bytes), started_ms_(now_ms()) {}

WorkerServer::~WorkerServer() {
  if (client_fd_ >= 0) ::close(client_fd_);
  if (listen_fd_ >= 0) {
    ::close(listen_fd_);
    ::unlink(opts_.socket_path.c_str());
  }
}

Status WorkerServer::listen() {
  namespace fs = std::filesystem;
  const std::string& path = opts_.socket_path;
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (path.empty() || path.size() >= sizeof(addr.sun_path))
    return make_error("socket path must be 1.." + std::to_string(sizeof(addr.sun_path) - 1) + " bytes: '" + path + "'");
  std::memcpy(addr.sun_path, path.c_str(), path.size() + 1);
  fs::path parent = fs::path(path).parent_path();
  if (!parent.empty()) {
    std::error_code ec;
    if (!fs::exists(parent, ec)) {
      fs::create_directories(parent.parent_path(), ec);
      if (::mkdir(parent.c_str(), 0700) != 0 && errno != EEXIST)
        return make_error("cannot create " + parent.string() + ": " + std::strerror(errno));
    }
  }
  struct stat st{};
  if (::lstat(path.c_str(), &st) == 0) {
    if (!S_ISSOCK(st.st_mode)) return make_error(path + " exists and is not a socket");
    ::unlink(path.c_str());  // stale socket of an earlier run
  }
  listen_fd_ = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (listen_fd_ < 0) return make_error(std::string("socket: ") + std::strerror(errno));
  const mode_t old_mask = ::umask(0177);  // the socket is born 0600
  const int rc = ::bind(listen_fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
  ::umask(old_mask);
  if (rc != 0) return make_error("bind " + path + ": " + std::strerror(errno));
  ::chmod(path.c_str(), 0600);
  if (::listen(listen_fd_, 4) != 0) return make_error("listen " + path + ": " + std::strerror(errno));
  set_nonblocking(listen_fd_);
  return {};
}

void WorkerServer::drop_client() {
  if (client_fd_ < 0) return;
  ::close(client_fd_);
  client_fd_ = -1;
  // The gateway that held these sequences is gone; their KV is freed.
  for (uint64_t id : client_seqs_) {
    backend_->release(id);
    if (opts_.hooks) opts_.hooks->released(id);  // their routing summaries still count
  }
  client_seqs_.clear();
  said_hello_ = false;
  close_after_flush_ = false;
  out_.clear();
  out_off_ = 0;
  decoder_ = pr::FrameDecoder(opts_.max_frame_bytes);
}

void WorkerServer::accept_client() {
  const int fd = ::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
  if (fd < 0) return;
  if (client_fd_ >= 0) std::fprintf(stderr, "moe-worker: a new gateway connection replaces the old one\n");
  drop_client();
  client_fd_ = fd;
}

void WorkerServer::queue(std::vector<uint8_t> bytes) {
  if (out_.empty()) {
    out_ = std::move(bytes);
    out_off_ = 0;
  } else {
    out_.insert(out_.end(), bytes.begin(), bytes.end());
  }
}

void WorkerServer::queue_error(uint64_t request_id, uint8_t command, ErrorCode code, const std::string& msg) {
  queue(pr::make_error_frame(request_id, command, code, msg));
}

bool WorkerServer::flush_some() {
  while (client_fd_ >= 0 && out_off_ < out_.size()) {
    const ssize_t n = ::send(client_fd_, out_.data() + out_off_, out_.size() - out_off_, MSG_NOSIGNAL);
    if (n > 0) {
      out_off_ += size_t(n);
      continue;
    }
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return true;
    if (n < 0 && errno == EINTR) continue;
    drop_client();
    return false;
  }
  if (out_off_ == out_.size()) {
    out_.clear();
    out_off_ = 0;
  }
  return client_fd_ >= 0;
}

void WorkerServer::flush_blocking() {
  while (client_fd_ >= 0 && !out_.empty()) {
    if (!flush_some()) return;
    if (out_.empty()) return;
    pollfd p{client_fd_, POLLOUT, 0};
    if (::poll(&p, 1, 5000) <= 0) return;
  }
}

void WorkerServer::read_client() {
  uint8_t buf[64 * 1024];
  for (;;) {
    const ssize_t n = ::recv(client_fd_, buf, sizeof(buf), 0);
    if (n == 0) {
      drop_client();
      return;
    }
    if (n < 0) {
      if (errno == EINTR) continue;
      if (errno != EAGAIN && errno != EWOULDBLOCK) drop_client();
      break;
    }
    decoder_.feed(std::span<const uint8_t>(buf, size_t(n)));
    if (size_t(n) < sizeof(buf)) break;
  }
  for (;;) {
    if (client_fd_ < 0 || close_after_flush_) return;
    pr::DecodeEvent ev = decoder_.next();
    if (ev.status == pr::DecodeStatus::need_more) return;
    if (ev.status == pr::DecodeStatus::error) {
      queue(pr::make_error_frame(ev.error));
      if (ev.error.fatal) close_after_flush_ = true;  // frame boundaries are lost
      continue;
    }
    handle_frame(ev.frame);
    if (exit_requested_) return;
  }
}

void WorkerServer::report_kv_pressure() {
  // KV pressure after a step or a release: warn below 10 % free (stop
  // admitting), evict below 3 % (shrink batches); said once per rise, again
  // after the pool was back above 20 % free.
  const int total = backend_->kv_blocks_total(), free = backend_->kv_blocks_free();
  if (total <= 0) return;
  const double f = double(free) / double(total);
  int level = f < 0.03 ? 2 : f < 0.10 ? 1 : 0;
  if (f >= 0.20) kv_pressure_said_ = 0;
  if (level <= kv_pressure_said_) return;
  kv_pressure_said_ = level;
  pr::Pressure p;
  p.level = level == 2 ? pr::PressureLevel::evict : pr::PressureLevel::warn;
  p.detail = "KV cache " + std::to_string(free) + " of " + std::to_string(total) + " blocks free";
  queue(pr::make_frame(0, p).value());
}

void WorkerServer::handle_frame(const pr::Frame& f) {
  const auto cmd = pr::Command(f.command);
  if (cmd == pr::Command::error || cmd == pr::Command::pong) return;  // never answered
  auto msg = pr::decode_message(f);
  if (!msg.ok()) {
    const bool limit = msg.error().find("limit") != std::string::npos;
    queue_error(f.request_id, f.command, limit ? ErrorCode::limit_exceeded : ErrorCode::malformed_payload, msg.error());
    return;
  }
  if (auto* h = std::get_if<pr::Hello>(&*msg)) {
    if (auto st = pr::check_version(*h); !st.ok()) {
      queue_error(f.request_id, f.command, ErrorCode::version_mismatch, st.error());
      close_after_flush_ = true;
      return;
    }
    pr::Hello mine = backend_->describe();
    mine.vram_budget_bytes = opts_.vram_budget_bytes;
    auto frame = pr::make_frame(f.request_id, mine, opts_.max_frame_bytes);
    if (!frame.ok()) {
      queue_error(f.request_id, f.command, ErrorCode::internal, frame.error());
      return;
    }
    said_hello_ = true;
    queue(std::move(frame.value()));
    return;
  }
  if (auto* p = std::get_if<pr::Ping>(&*msg)) {  // liveness is answered even before hello
    queue(pr::make_frame(f.request_id, pr::Pong{p->sent_us, now_us()}).value());
    return;
  }
  if (!said_hello_) {
    queue_error(f.request_id, f.command, ErrorCode::not_ready, "send hello first");
    return;
  }
  if (auto* s = std::get_if<pr::StepRequest>(&*msg)) {
    pr::StepReply reply = backend_->step(*s);
    if (const std::string why = backend_->broken(); !why.empty()) {
      pr::Pressure p;
      p.level = pr::PressureLevel::break_;
      p.detail = why;
      queue(pr::make_frame(0, p).value());
      std::fprintf(stderr, "moe-worker: the backend is broken (%s); exiting for a restart\n", why.c_str());
      exit_requested_ = true;
      exit_code_ = 3;
      return;
    }
    if (opts_.hooks) opts_.hooks->after_step(*s, reply);
    ++steps_;
    for (size_t i = 0; i < reply.results.size(); ++i) {
      const pr::StepResult& r = reply.results[i];
      if (r.error != ErrorCode::none) continue;
      client_seqs_.insert(r.seq_id);
      tokens_ += s->sequences[i].tokens.size();
      if (r.sampled) ++sampled_tokens_;
    }
    auto frame = pr::make_frame(f.request_id, reply, opts_.max_frame_bytes);
    if (!frame.ok()) {
      queue_error(f.request_id, f.command, ErrorCode::limit_exceeded, frame.error());
      return;
    }
    queue(std::move(frame.value()));
    report_kv_pressure();
  } else if (auto* rel = std::get_if<pr::ReleaseSequences>(&*msg)) {
    for (uint64_t id : rel->seq_ids) {
      backend_->release(id);
      client_seqs_.erase(id);
      if (opts_.hooks) opts_.hooks->released(id);
    }
    report_kv_pressure();  // the pool may be roomy again
  } else if (auto* sr = std::get_if<pr::StatsRequest>(&*msg)) {
    pr::StatsReply r;
    r.kv_blocks_free = uint32_t(backend_->kv_blocks_free());
    r.kv_blocks_used = uint32_t(backend_->kv_blocks_total() - backend_->kv_blocks_free());
    r.steps = steps_;
    r.tokens = tokens_;
    r.sampled_tokens = sampled_tokens_;
    r.sequences_active = uint32_t(backend_->sequences_active());
    r.uptime_ms = now_ms() - started_ms_;
    backend_->fill_expert_stats(r);
    if (sr->include_resident) r.resident = backend_->resident();
    queue(pr::make_frame(f.request_id, r).value());
  } else if (auto* sd = std::get_if<pr::Shutdown>(&*msg)) {
    // Every step received before it was answered already (steps run in order).
    std::fprintf(stderr, "moe-worker: shutdown requested (%s)\n", sd->reason.c_str());
    exit_requested_ = true;
  } else if (auto* le = std::get_if<pr::LoadExpert>(&*msg)) {
    queue(pr::make_frame(f.request_id, backend_->load_experts(*le)).value());
  } else if (auto* ue = std::get_if<pr::UnloadExpert>(&*msg)) {
    queue(pr::make_frame(f.request_id, backend_->unload_experts(*ue)).value());
  } else if (auto* wh = std::get_if<pr::WarmHints>(&*msg)) {
    std::vector<pr::ExpertRef> experts;
    for (const pr::ExpertHint& h : wh->hints) experts.push_back({h.layer, h.expert});
    backend_->hint(experts);
  } else {
    queue_error(f.request_id, f.command, ErrorCode::invalid_argument,
                std::string(pr::command_name(f.command)) + " is not a request a worker takes");
  }
}

Status WorkerServer::run(int stop_fd) {
  for (;;) {
    pollfd fds[3];
    nfds_t n = 0;
    fds[n++] = {stop_fd, POLLIN, 0};
    fds[n++] = {listen_fd_, POLLIN, 0};
    const bool have_client = client_fd_ >= 0;
    if (have_client) fds[n++] = {client_fd_, short(POLLIN | (out_.empty() ? 0 : POLLOUT)), 0};
    const int rc = ::poll(fds, n, -1);
    if (rc < 0) {
      if (errno == EINTR) continue;
      return make_error(std::string("poll: ") + std::strerror(errno));
    }
    if (fds[0].revents) {
      // SIGTERM: stop accepting; what was answered is written, then we leave.
      ::close(listen_fd_);
      listen_fd_ = -1;
      ::unlink(opts_.socket_path.c_str());
      flush_blocking();
      drop_client();
      return {};
    }
    if (fds[1].revents & POLLIN) accept_client();
    if (have_client && client_fd_ >= 0 && n == 3 && fds[2].fd == client_fd_) {
      if (fds[2].revents & (POLLIN | POLLHUP | POLLERR)) read_client();
      if (client_fd_ >= 0 && !flush_some()) continue;
    }
    if (exit_requested_) {
      flush_blocking();
      drop_client();
      return {};
    }
    if (close_after_flush_) {
      flush_blocking();
      drop_client();
    }
  }
}

}  // namespace moe::worker
