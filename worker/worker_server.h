#pragma once
// The worker's Unix-socket server: one gateway connection at a time, frames
// decoded incrementally, steps run on the calling thread through a Backend.
// Plain POSIX sockets and poll(), so the worker links nothing but our
// libraries.
//
// Who may talk to it: a peer of this user (or root), checked with
// SO_PEERCRED, on a socket made 0600 in a 0700 folder. While a gateway is
// connected and was heard from in the last 3 s, a second connection is
// refused (an error frame `busy`, then close), so no other local process can
// take the gateway's place or send it `shutdown`; a connection silent that
// long (its gateway frozen or gone) gives way to the new one.
//
// What a peer can make it hold: output waiting for the gateway past
// kOutHighWater stops the reading of input (what is read comes in pieces of
// at most 64 KiB, each fully handled before the next), so neither the
// outgoing bytes nor the decoded frames grow without bound.
//
// Liveness: while a step (or any frame's work) has run on the step thread
// for 500 ms or more, a beat thread sends the gateway a pong (request id 0)
// every 500 ms as long as the backend reports progress
// (Backend::set_progress: it counts layers and experts) within the last
// 500 ms. A step stuck in a kernel that never returns goes silent, and the
// gateway fails over within 3 s (half a second without progress, then 2.5 s
// of silence); one stuck for `stall_exit_s` ends the process (exit 3) so that its supervisor restarts
// it. The beat thread also ends the worker when `parent_pid` is gone.
//
// Error policy (docs/protocol.md): a recoverable frame error is answered with
// an error frame and the connection kept; a fatal one (length field out of
// bounds) is answered with an error frame (request id 0) and the connection
// closed; the server keeps listening either way.

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_set>
#include <vector>

#include "card/health_monitor.h"
#include "worker/backend.h"
#include "model/result.h"
#include "protocol/frame.h"

namespace moe::worker {

// Observers of the step thread's work (the Redis state publisher): called on
// that thread after each step and each released sequence; must not block.
class StepHooks {
 public:
  virtual ~StepHooks() = default;
  virtual void after_step(const protocol::StepRequest& req, const protocol::StepReply& reply) = 0;
  virtual void released(uint64_t seq_id) = 0;
};

struct ServerOptions {
  std::string socket_path;
  size_t max_frame_bytes = protocol::kMaxFrameBytes;
  uint64_t vram_budget_bytes = 0;  // reported in hello
  std::vector<StepHooks*> hooks;   // called in order; each must outlive the server
  // The card's health for stats replies; null: the backend has no card.
  const CardHealthMonitor* card = nullptr;
  int parent_pid = 0;              // > 0: exit when that process is gone
  int stall_exit_s = 30;           // a step without progress this long ends the process
};

class WorkerServer {
 public:
  // Bytes waiting for the gateway past which no more input is read.
  static constexpr size_t kOutHighWater = size_t(1) << 20;
  // A connection heard from within this keeps a second one out.
  static constexpr uint64_t kLiveClientMs = 3000;

  WorkerServer(Backend* backend, ServerOptions opts);
  ~WorkerServer();
  WorkerServer(const WorkerServer&) = delete;
  WorkerServer& operator=(const WorkerServer&) = delete;

  // Creates the socket's parent directory (0700) when missing, replaces a
  // stale socket, binds (0600) and listens.
  Status listen();
  // Serves until `stop_fd` becomes readable (SIGTERM's self-pipe) or a
  // gateway sends shutdown; the reply of a step in flight is written first.
  Status run(int stop_fd);

  // Work served so far (the exit summary).
  uint64_t steps() const { return steps_; }
  uint64_t tokens() const { return tokens_; }
  uint64_t sampled_tokens() const { return sampled_tokens_; }
  // The process exit status run() asks for: 0, or 3 when the backend broke.
  int exit_code() const { return exit_code_; }

 private:
  void accept_client();
  void refuse(int fd, const std::string& why);
  void drop_client();
  void read_client();
  void pump_frames();  // handles decoded frames while the output is below the high water
  void handle_frame(const protocol::Frame& f);
  void run_step(const protocol::Frame& f, const protocol::StepRequest& s);
  void queue(std::vector<uint8_t> bytes);
  void report_kv_pressure();
  void queue_error(uint64_t request_id, uint8_t command, protocol::ErrorCode code, const std::string& msg);
  bool flush_some();     // false when the client is gone
  void flush_blocking();  // before closing
  size_t out_pending() {
    std::lock_guard<std::mutex> lk(write_mu_);
    return out_.size() - out_off_;
  }
  void beat_loop();       // the beat thread
  bool send_locked(const uint8_t* data, size_t n, size_t* sent);  // write_mu_ held

  Backend* backend_;
  ServerOptions opts_;
  int listen_fd_ = -1;
  int client_fd_ = -1;
  bool said_hello_ = false;
  bool close_after_flush_ = false;
  bool exit_requested_ = false;
  protocol::FrameDecoder decoder_;
  // Guards out_, out_off_ and writes to client_fd_: the beat thread writes too.
  std::mutex write_mu_;
  std::vector<uint8_t> out_;  // bytes not yet written to the client
  size_t out_off_ = 0;
  std::unordered_set<uint64_t> client_seqs_;  // sequences the current gateway holds
  uint64_t started_ms_ = 0;
  uint64_t last_rx_ms_ = 0;  // when the current client last sent anything
  uint64_t last_work_done_ms_ = 0;  // when the step thread last finished a frame
  uint64_t steps_ = 0, tokens_ = 0, sampled_tokens_ = 0;
  uint64_t last_idle_ms_ = 0;  // Backend::idle, about once a second from the poll loop
  int kv_pressure_said_ = 0;  // 0 none, 1 warn, 2 evict: the last level sent since the pool was roomy
  int exit_code_ = 0;
  std::string no_card_reason_;  // a stats reply's CardHealth.reason without a card

  // The beat thread and what it watches.
  std::atomic<uint64_t> progress_{0};  // bumped by the backend as a step advances
  std::atomic<uint64_t> busy_since_ms_{0};  // when the step thread began the frame it handles (0: idle)
  std::atomic<bool> stop_beat_{false};
  std::thread beat_;
};

}  // namespace moe::worker
