#pragma once
// Runs the gateway's own moe-worker child when no --worker is given: a socket
// in a private temporary directory (0700), the child watched through its exit
// callback and restarted with backoff when it dies. The WorkerLink that
// talks to it reconnects by itself; the scheduler resubmits what was running.
//
// Nothing outlives the gateway: the child is started with --parent-pid, so
// it exits when the gateway does, however the gateway ends (kill -9 too),
// and the folder holds the gateway's pid file, locked (flock) while the
// supervisor lives, and the child's pid, so that the next gateway removes
// folders nobody holds (and kills a child of such a folder that is somehow
// still there) before it makes its own.

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <uv.h>

#include "model/result.h"

namespace moe::gw {

struct SupervisorOptions {
  std::string worker_bin;               // the moe-worker executable
  std::string model_path;               // --model for the child
  std::vector<std::string> extra_args;  // e.g. {"--threads", "2"}
  uint64_t restart_min_ms = 100;
  uint64_t restart_max_ms = 5000;
  // The socket's file name in the private directory; its stem is the name
  // the worker goes by in Redis.
  std::string socket_name = "worker.sock";
  // Exits in a row before a child was ready (a checkpoint broken since the
  // start, a setting only the worker refuses) after which the worker counts
  // as failing: what waits for it ends with the reason, instead of waiting
  // for a restart that does not come. Restarts go on (a fixed checkpoint
  // serves again); the count starts over once a child is ready.
  int failing_after = 3;
};

// The moe-worker to start: `explicit_path` when set, else next to the
// running binary (<exe dir>/../worker/moe-worker in the build tree, or
// <exe dir>/moe-worker), else on PATH.
Result<std::string> find_worker_binary(const std::string& explicit_path);

class WorkerSupervisor {
 public:
  // Makes the private socket directory and starts the child.
  static Result<std::unique_ptr<WorkerSupervisor>> start(uv_loop_t* loop, SupervisorOptions opts);
  // Stops the child (SIGTERM) and removes the socket directory.
  ~WorkerSupervisor();
  WorkerSupervisor(const WorkerSupervisor&) = delete;
  WorkerSupervisor& operator=(const WorkerSupervisor&) = delete;

  const std::string& socket_path() const { return socket_path_; }
  const std::string& folder() const { return dir_; }
  int child_pid() const;              // 0 while none runs
  uint64_t restarts() const { return restarts_; }
  // The scheduler says a child answered its hello: the exits count anew.
  void note_ready() { failed_starts_ = 0; }
  // failing_after exits (or failed spawns) in a row since a child was last ready.
  bool failing() const { return failed_starts_ >= opts_.failing_after; }
  // Why, in a sentence for a client and /health (empty while not failing).
  std::string failing_reason() const;
  // Called once each time the worker starts failing.
  void on_failing(std::function<void()> f) { on_failing_ = std::move(f); }
  // SIGKILLs the running child (it stopped answering); it is restarted as
  // after any exit.
  void kill_child(const char* why);

  // Removes the moe-gateway-* folders under `temp_dir` whose gateway is no
  // longer running (killing a child still running there); returns how many.
  static size_t remove_stale_folders(const std::string& temp_dir);

 private:
  WorkerSupervisor(uv_loop_t* loop, SupervisorOptions opts) : loop_(loop), opts_(std::move(opts)) {}
  Status spawn();
  static void on_exit(uv_process_t* p, int64_t status, int signal);
  static void on_restart_timer(uv_timer_t* t);
  void exited(int64_t status, int signal);
  void restart();
  void count_failure(std::string what);

  uv_loop_t* loop_;
  SupervisorOptions opts_;
  std::string dir_, socket_path_;
  uv_process_t* proc_ = nullptr;  // the running child, or nullptr
  uv_timer_t* restart_timer_ = nullptr;
  uint64_t backoff_ms_ = 0;
  uint64_t started_ms_ = 0;
  uint64_t restarts_ = 0;
  int failed_starts_ = 0;
  std::string last_failure_;
  std::function<void()> on_failing_;
  int lock_fd_ = -1;  // gateway.pid, locked while this supervisor lives
};

}  // namespace moe::gw
