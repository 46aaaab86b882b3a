#pragma once
// The worker's Unix-socket server: one gateway connection at a time (a new
// connection replaces the old one and frees its sequences), frames decoded
// incrementally, steps run on the calling thread through a Backend. Plain
// POSIX sockets and poll(), so the worker links nothing but our libraries.
//
// Error policy (docs/protocol.md): a recoverable frame error is answered with
// an error frame and the connection kept; a fatal one (length field out of
// bounds) is answered with an error frame (request id 0) and the connection
// closed; the server keeps listening either way.

#include <cstddef>
#include <cstdint>
#include <string>
#include <unordered_set>
#include <vector>

#include "gpu_worker/backend.h"
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
  StepHooks* hooks = nullptr;      // optional, must outlive the server
};

class WorkerServer {
 public:
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
  void drop_client();
  void read_client();
  void handle_frame(const protocol::Frame& f);
  void queue(std::vector<uint8_t> bytes);
  void report_kv_pressure();
  void queue_error(uint64_t request_id, uint8_t command, protocol::ErrorCode code, const std::string& msg);
  bool flush_some();     // false when the client is gone
  void flush_blocking();  // before closing

  Backend* backend_;
  ServerOptions opts_;
  int listen_fd_ = -1;
  int client_fd_ = -1;
  bool said_hello_ = false;
  bool close_after_flush_ = false;
  bool exit_requested_ = false;
  protocol::FrameDecoder decoder_;
  std::vector<uint8_t> out_;  // bytes not yet written to the client
  size_t out_off_ = 0;
  std::unordered_set<uint64_t> client_seqs_;  // sequences the current gateway holds
  uint64_t started_ms_ = 0;
  uint64_t steps_ = 0, tokens_ = 0, sampled_tokens_ = 0;
  int kv_pressure_said_ = 0;  // 0 none, 1 warn, 2 evict: the last level sent since the pool was roomy
  int exit_code_ = 0;
};

}  // namespace moe::worker
