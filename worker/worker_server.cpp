#include "worker/worker_server.h"

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <variant>

#include <csignal>
#include <cstdlib>

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

// Faults the integration tests inject through MOE_WORKER_FAULT, to prove
// what the gateway does when a step never returns or runs long:
//   hang-step=N      the Nth step (from 1) blocks for ever, making no progress
//   slow-step=N:MS   from the Nth step on, each step first runs MS ms longer,
//                    making progress all the while
struct InjectedFault {
  uint64_t hang_step = 0;
  uint64_t slow_step = 0;
  uint64_t slow_ms = 0;
};

InjectedFault injected_fault() {
  InjectedFault f;
  const char* v = std::getenv("MOE_WORKER_FAULT");
  if (!v) return f;
  const std::string s = v;
  if (s.rfind("hang-step=", 0) == 0) {
    f.hang_step = std::strtoull(s.c_str() + 10, nullptr, 10);
  } else if (s.rfind("slow-step=", 0) == 0) {
    char* end = nullptr;
    f.slow_step = std::strtoull(s.c_str() + 10, &end, 10);
    if (end && *end == ':') f.slow_ms = std::strtoull(end + 1, nullptr, 10);
  }
  if (f.hang_step || f.slow_step)
    std::fprintf(stderr, "moe-worker: MOE_WORKER_FAULT=%s (a test's injected fault)\n", s.c_str());
  return f;
}

const InjectedFault& fault() {
  static const InjectedFault f = injected_fault();
  return f;
}

// The peer's user must be ours (or root).
bool peer_allowed(int fd, std::string* why) {
  ucred cred{};
  socklen_t len = sizeof(cred);
  if (::getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0) {
    *why = std::string("SO_PEERCRED: ") + std::strerror(errno);
    return false;
  }
  if (cred.uid == ::geteuid() || cred.uid == 0) return true;
  *why = "a process of uid " + std::to_string(cred.uid) + " (pid " + std::to_string(cred.pid) + ")";
  return false;
}
}  // namespace

WorkerServer::WorkerServer(Backend* backend, ServerOptions opts)
    : backend_(backend), opts_(std::move(opts)), decoder_(opts_.max_frame_bytes), started_ms_(now_ms()) {
  backend_->set_progress(&progress_);
  if (!opts_.card) no_card_reason_ = "the " + backend_->describe().backend + " backend computes on no card";
  (void)fault();
}

WorkerServer::~WorkerServer() {
  stop_beat_ = true;
  if (beat_.joinable()) beat_.join();
  backend_->set_progress(nullptr);
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
  {
    std::lock_guard<std::mutex> lk(write_mu_);
    ::close(client_fd_);
    client_fd_ = -1;
    out_.clear();
    out_off_ = 0;
  }
  // The gateway that held these sequences is gone; their KV is freed.
  for (uint64_t id : client_seqs_) {
    backend_->release(id);
    for (StepHooks* h : opts_.hooks) h->released(id);  // their routing summaries still count
  }
  client_seqs_.clear();
  said_hello_ = false;
  close_after_flush_ = false;
  decoder_ = pr::FrameDecoder(opts_.max_frame_bytes);
}

void WorkerServer::refuse(int fd, const std::string& why) {
  std::fprintf(stderr, "moe-worker: refusing a connection: %s\n", why.c_str());
  const auto frame = pr::make_error_frame(0, uint8_t(pr::Command::hello), ErrorCode::busy, why);
  [[maybe_unused]] ssize_t n = ::send(fd, frame.data(), frame.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
  ::close(fd);
}

void WorkerServer::accept_client() {
  const int fd = ::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
  if (fd < 0) return;
  std::string why;
  if (!peer_allowed(fd, &why)) return refuse(fd, why + " may not use this worker");
  bool waiting_bytes = false;
  if (client_fd_ >= 0) {
    // The current gateway may have left in the same instant (its EOF not yet
    // read), or may have sent what we have not read yet (we were busy).
    pollfd p{client_fd_, short(POLLIN | POLLRDHUP), 0};
    if (::poll(&p, 1, 0) > 0) {
      if (p.revents & (POLLHUP | POLLRDHUP | POLLERR)) {
        drop_client();
      } else if (p.revents & POLLIN) {
        waiting_bytes = true;
      }
    }
  }
  if (client_fd_ >= 0) {
    // Heard from lately, or only unheard because this thread was busy with
    // its frames: live.
    const uint64_t heard = std::max(last_rx_ms_, last_work_done_ms_);
    if (waiting_bytes || now_ms() - heard < kLiveClientMs)
      return refuse(fd, "a gateway is connected to this worker (one at a time)");
    std::fprintf(stderr, "moe-worker: the connected gateway has been silent for %llu ms; the new one replaces it\n",
                 (unsigned long long)(now_ms() - heard));
  }
  drop_client();
  std::lock_guard<std::mutex> lk(write_mu_);
  client_fd_ = fd;
  last_rx_ms_ = now_ms();
}

void WorkerServer::queue(std::vector<uint8_t> bytes) {
  std::lock_guard<std::mutex> lk(write_mu_);
  if (out_.empty()) {
    out_ = std::move(bytes);
    out_off_ = 0;
  } else {
    out_.insert(out_.end(), bytes.begin(), bytes.end());
  }
}

bool WorkerServer::send_locked(const uint8_t* data, size_t n, size_t* sent) {
  *sent = 0;
  while (*sent < n) {
    const ssize_t k = ::send(client_fd_, data + *sent, n - *sent, MSG_NOSIGNAL);
    if (k > 0) {
      *sent += size_t(k);
      continue;
    }
    if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return true;
    if (k < 0 && errno == EINTR) continue;
    return false;
  }
  return true;
}

void WorkerServer::queue_error(uint64_t request_id, uint8_t command, ErrorCode code, const std::string& msg) {
  queue(pr::make_error_frame(request_id, command, code, msg));
}

bool WorkerServer::flush_some() {
  bool ok = true;
  {
    std::lock_guard<std::mutex> lk(write_mu_);
    if (client_fd_ < 0) return false;
    size_t sent = 0;
    ok = send_locked(out_.data() + out_off_, out_.size() - out_off_, &sent);
    out_off_ += sent;
    if (out_off_ == out_.size()) {
      out_.clear();
      out_off_ = 0;
    }
  }
  if (!ok) {
    drop_client();
    return false;
  }
  return true;
}

void WorkerServer::flush_blocking() {
  while (client_fd_ >= 0 && out_pending() > 0) {
    if (!flush_some()) return;
    if (out_pending() == 0) return;
    pollfd p{client_fd_, POLLOUT, 0};
    if (::poll(&p, 1, 5000) <= 0) return;
  }
}

void WorkerServer::read_client() {
  // One piece at a time: its frames are all handled (or wait for the output
  // to drain) before the next is read.
  uint8_t buf[64 * 1024];
  ssize_t n;
  do {
    n = ::recv(client_fd_, buf, sizeof(buf), 0);
  } while (n < 0 && errno == EINTR);
  if (n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK)) {
    drop_client();
    return;
  }
  if (n < 0) return;
  last_rx_ms_ = now_ms();
  decoder_.feed(std::span<const uint8_t>(buf, size_t(n)));
  pump_frames();
}

void WorkerServer::pump_frames() {
  while (client_fd_ >= 0 && !close_after_flush_ && !exit_requested_ && out_pending() < kOutHighWater) {
    pr::DecodeEvent ev = decoder_.next();
    if (ev.status == pr::DecodeStatus::need_more) return;
    if (ev.status == pr::DecodeStatus::error) {
      queue(pr::make_error_frame(ev.error));
      if (ev.error.fatal) close_after_flush_ = true;  // frame boundaries are lost
      continue;
    }
    busy_since_ms_ = now_ms();
    progress_.fetch_add(1, std::memory_order_relaxed);
    handle_frame(ev.frame);
    busy_since_ms_ = 0;
    last_work_done_ms_ = now_ms();
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

void WorkerServer::run_step(const pr::Frame& f, const pr::StepRequest& step) {
  const pr::StepRequest* s = &step;
  const uint64_t n = steps_ + 1;
  if (fault().hang_step == n) {
    std::fprintf(stderr, "moe-worker: injected fault: step %llu never returns\n", (unsigned long long)n);
    for (;;) ::pause();
  }
  if (fault().slow_step && n >= fault().slow_step) {
    for (uint64_t t = 0; t < fault().slow_ms; t += 100) {
      ::usleep(100'000);
      progress_.fetch_add(1, std::memory_order_relaxed);
    }
  }
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
    for (StepHooks* h : opts_.hooks) h->after_step(*s, reply);
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
    run_step(f, *s);
  } else if (auto* rel = std::get_if<pr::ReleaseSequences>(&*msg)) {
    for (uint64_t id : rel->seq_ids) {
      backend_->release(id);
      client_seqs_.erase(id);
      for (StepHooks* h : opts_.hooks) h->released(id);
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
    if (opts_.card)
      r.card = opts_.card->latest();
    else
      r.card.reason = no_card_reason_;
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

void WorkerServer::beat_loop() {
  using namespace std::chrono_literals;
  uint64_t seen = progress_.load(std::memory_order_relaxed);
  uint64_t changed_ms = now_ms(), last_beat_ms = 0, last_loop_ms = now_ms(), parent_gone_ms = 0;
  while (!stop_beat_.load()) {
    std::this_thread::sleep_for(100ms);
    const uint64_t now = now_ms();
    // A loop that took seconds means the whole process stood still
    // (SIGSTOP): that is not the step's fault.
    if (now - last_loop_ms > 2000) changed_ms = now;
    last_loop_ms = now;
    const uint64_t p = progress_.load(std::memory_order_relaxed);
    if (p != seen) {
      seen = p;
      changed_ms = now;
    }
    if (opts_.parent_pid > 0 && ::getppid() != opts_.parent_pid) {
      if (!parent_gone_ms) {
        std::fprintf(stderr, "moe-worker: the process that started this worker (pid %d) is gone; exiting\n",
                     opts_.parent_pid);
        parent_gone_ms = now;
        ::kill(::getpid(), SIGTERM);
      } else if (now - parent_gone_ms > 10'000) {
        std::fprintf(stderr, "moe-worker: still running 10 s after the parent left; exiting now\n");
        std::_Exit(1);
      }
    }
    const uint64_t busy_since = busy_since_ms_.load();
    if (busy_since == 0) {
      changed_ms = now;  // idle: the step thread answers pings itself
      continue;
    }
    if (now - changed_ms >= uint64_t(opts_.stall_exit_s) * 1000) {
      std::fprintf(stderr, "moe-worker: a step has made no progress for %d s; exiting (3) for a restart\n",
                   opts_.stall_exit_s);
      std::_Exit(3);
    }
    // A step that advances says so twice a second; one that made no progress
    // for half a second goes silent.
    if (now - busy_since >= 500 && now - changed_ms < 500 && now - last_beat_ms >= 500) {
      last_beat_ms = now;
      const auto frame = pr::make_frame(0, pr::Pong{0, now_us()}).value();
      std::lock_guard<std::mutex> lk(write_mu_);
      if (client_fd_ < 0) continue;
      out_.insert(out_.end(), frame.begin(), frame.end());
      size_t sent = 0;
      if (send_locked(out_.data() + out_off_, out_.size() - out_off_, &sent)) out_off_ += sent;
      if (out_off_ == out_.size()) {
        out_.clear();
        out_off_ = 0;
      }
    }
  }
}

Status WorkerServer::run(int stop_fd) {
  beat_ = std::thread([this] { beat_loop(); });
  for (;;) {
    // Frames decoded earlier that waited for the output to drain.
    if (client_fd_ >= 0 && decoder_.queued_events() > 0 && out_pending() < kOutHighWater) {
      pump_frames();
      if (client_fd_ >= 0) flush_some();
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
    pollfd fds[3];
    nfds_t n = 0;
    fds[n++] = {stop_fd, POLLIN, 0};
    fds[n++] = {listen_fd_, POLLIN, 0};
    const bool have_client = client_fd_ >= 0;
    const size_t pending = out_pending();
    // No more input while the gateway has not taken our output.
    const bool want_input = pending < kOutHighWater && decoder_.queued_events() == 0;
    if (have_client) fds[n++] = {client_fd_, short((want_input ? POLLIN : 0) | (pending ? POLLOUT : 0)), 0};
    // Woken at least once a second for the backend's idle work.
    const int rc = ::poll(fds, n, 1000);
    if (const uint64_t now = now_ms(); now - last_idle_ms_ >= 1000) {
      last_idle_ms_ = now;
      backend_->idle();
    }
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
    // The gateway's input first: a connection waiting to be accepted is
    // judged against a client whose latest bytes were read.
    if (have_client && client_fd_ >= 0 && n == 3 && fds[2].fd == client_fd_) {
      if (fds[2].revents & (POLLIN | POLLHUP | POLLERR)) read_client();
      if (client_fd_ >= 0) flush_some();
    }
    if (fds[1].revents & POLLIN) accept_client();
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
