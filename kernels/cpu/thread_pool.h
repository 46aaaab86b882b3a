#pragma once
// A small fork-join pool for the CPU kernels: parallel_for splits [0, n) into
// tasks that the workers and the calling thread take one at a time. Owned by
// its user (the engine, a test); kernels take a ThreadPool* and run serially
// when it is null. One parallel_for at a time: calls from several threads
// are serialised.

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace moe::cpu {

class ThreadPool {
 public:
  // threads: total workers including the caller; 0 means all hardware threads.
  explicit ThreadPool(int threads = 0);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const { return int(workers_.size()) + 1; }

  // Calls fn(i) once for every i in [0, n), spread over the pool; returns when
  // all calls have returned. fn must not call parallel_for on the same pool.
  void parallel_for(int64_t n, const std::function<void(int64_t)>& fn);

 private:
  void worker_loop();
  void run_tasks();

  std::vector<std::thread> workers_;
  std::mutex call_mu_;  // serialises parallel_for callers
  std::mutex mu_;
  std::condition_variable wake_, done_;
  const std::function<void(int64_t)>* fn_ = nullptr;
  int64_t n_ = 0;
  std::atomic<int64_t> next_{0};
  std::atomic<int> busy_{0};             // workers still inside the current job
  std::atomic<uint64_t> generation_{0};  // bumped (under mu_) for every job
  std::atomic<bool> stop_{false};
};

// Runs fn(i) for i in [0, n) on `pool`, or inline when pool is null or n <= 1.
void parallel_for(ThreadPool* pool, int64_t n, const std::function<void(int64_t)>& fn);

}  // namespace moe::cpu
