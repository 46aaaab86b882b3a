#pragma once
// A libuv client for one worker's Unix socket: connects (retrying with
// backoff), says hello and checks the worker's version, sends frames, cuts
// the replies into frames, and pings. A worker that sends nothing for
// `dead_after_ms` while a ping is outstanding is marked down (unresponsive):
// the connection is closed and reconnecting starts over. A worker in a long
// step still sends a pong (request id 0) about twice a second while its step
// makes progress (docs/protocol.md), so only a frozen worker, or one stuck in
// a kernel that never returns, goes silent. Before declaring a worker dead
// the link looks whether its bytes are merely waiting in the socket (this
// loop was busy), so a slow gateway never kills a healthy worker.
// Everything runs on the loop thread; callbacks are called there.
//
// Lifetime: the uv handles live on the heap and are closed by the
// destructor, so a link may be destroyed at any time on the loop thread.

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include <uv.h>

#include "model/result.h"
#include "protocol/frame.h"
#include "protocol/messages.h"

namespace moe::gw {

// The token ids every worker's model must share with the gateway's: running
// requests move between workers (failover to the fallback and back) as token
// ids, and the gateway encodes prompts and decodes replies with its own
// tokenizer. Compared with what the worker's hello says of its model (the
// vocabulary size and EOS ids of its config.json). vocab_size 0: no check.
struct WorkerVocabulary {
  std::string model;             // the gateway's model, named in the message
  uint32_t vocab_size = 0;
  std::vector<int32_t> eos_ids;  // any order
};

// ok, or why a worker whose hello is `h` cannot serve a gateway expecting `v`.
[[nodiscard]] Status check_vocabulary(const protocol::Hello& h, const WorkerVocabulary& v);

struct WorkerLinkOptions {
  std::string socket_path;
  std::string instance = "moe-gateway";
  uint64_t heartbeat_ms = 1000;
  uint64_t dead_after_ms = 2500;   // silence while a ping is outstanding
  size_t max_write_queue_bytes = size_t(256) << 20;  // a worker further behind is treated as gone
  uint64_t retry_min_ms = 20;
  uint64_t retry_max_ms = 1000;
  size_t max_frame_bytes = protocol::kMaxFrameBytes;
  // A worker whose hello names another vocabulary is refused (never ready):
  // logged once per reason, and the link keeps retrying in case it is replaced.
  WorkerVocabulary vocabulary;
};

class WorkerLink {
 public:
  struct Callbacks {
    std::function<void(const protocol::Hello&)> on_ready;  // handshake done
    std::function<void(const protocol::Frame&)> on_frame;  // every later frame but pongs
    // A ready link lost its worker; `unresponsive`: it went silent (frozen)
    // rather than closing the connection.
    std::function<void(const std::string& reason, bool unresponsive)> on_down;
  };

  WorkerLink(uv_loop_t* loop, WorkerLinkOptions opts, Callbacks cb);
  ~WorkerLink();
  WorkerLink(const WorkerLink&) = delete;
  WorkerLink& operator=(const WorkerLink&) = delete;

  void start();  // connect (and keep reconnecting) until destroyed
  bool ready() const { return state_ == State::ready; }
  const protocol::Hello& worker_hello() const { return hello_; }
  const std::string& socket_path() const { return opts_.socket_path; }
  // Why its last hello was refused (check_vocabulary); empty once one is taken.
  const std::string& refused() const { return refused_; }
  // Why its last connection, or try to connect, ended ("connect: connection
  // refused", "the worker closed the connection"); empty before the first.
  const std::string& last_failure() const { return last_failure_; }

  // Sends a message; its request id is returned. Fails when not ready.
  Result<uint64_t> send(const protocol::Message& m);
  // Drops the connection as if the worker died (tests, protocol violations).
  void drop(const std::string& reason, bool unresponsive = false);

 private:
  enum class State { idle, connecting, handshaking, ready };
  static void on_connect(uv_connect_t* req, int status);
  static void on_alloc(uv_handle_t* h, size_t suggested, uv_buf_t* buf);
  static void on_read(uv_stream_t* s, ssize_t n, const uv_buf_t* buf);
  static void on_timer(uv_timer_t* t);
  void connect_now();
  void schedule_retry();
  Status write_frame(std::vector<uint8_t> bytes);
  void handle(const protocol::Frame& f);
  void on_read_bytes(ssize_t n, const uv_buf_t* buf);
  void on_tick();
  void connected(int status);
  bool bytes_waiting() const;  // the worker's bytes sit unread in the socket
  uint64_t now_ms() const { return uv_now(loop_); }

  uv_loop_t* loop_;
  WorkerLinkOptions opts_;
  Callbacks cb_;
  State state_ = State::idle;
  uv_pipe_t* pipe_ = nullptr;
  uv_timer_t* timer_ = nullptr;  // retry while down, heartbeat while up
  protocol::FrameDecoder decoder_;
  protocol::Hello hello_;
  uint64_t next_request_id_ = 1;
  uint64_t hello_request_id_ = 0;
  uint64_t retry_ms_ = 0;
  uint64_t last_rx_ms_ = 0;
  uint64_t ping_outstanding_since_ms_ = 0;  // 0: none
  uint64_t last_ping_ms_ = 0;
  std::string refused_;  // why the last hello was refused (logged once)
  std::string last_failure_;
  // A worker never reached: when the streak of failed connections began (0:
  // none), and whether it was said (after kUnreachableSayMs: a worker loading
  // its model is not yet listening, and says so itself).
  uint64_t unreachable_since_ms_ = 0;
  bool unreachable_said_ = false;
};

}  // namespace moe::gw
