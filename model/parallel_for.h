#pragma once
// fn(0 .. n-1) on up to `threads` threads (the caller's among them), each
// taking the next index: the one loop behind the model readers' and the
// packer's conversions.

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <thread>
#include <vector>

namespace moe {

template <typename Fn>
void parallel_for(size_t n, size_t threads, Fn&& fn) {
  std::atomic<size_t> next{0};
  auto work = [&] {
    for (size_t k; (k = next.fetch_add(1)) < n;) fn(k);
  };
  std::vector<std::thread> pool;
  for (size_t t = 1; t < std::min(threads, n); ++t) pool.emplace_back(work);
  work();
  for (auto& th : pool) th.join();
}

// One thread per core.
inline size_t host_threads() { return std::max(1u, std::thread::hardware_concurrency()); }

}  // namespace moe
