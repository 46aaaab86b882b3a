#include "gateway/last_resort.h"

#include <atomic>
#include <cstdio>

namespace moe::gw {
namespace {
// One per process, like the log it goes with; read by /metrics.
std::atomic<uint64_t> g_escaped{0};
}  // namespace

void report_escaped_exception(const char* where, const char* what) noexcept {
  g_escaped.fetch_add(1, std::memory_order_relaxed);
  std::fprintf(stderr, "moe-gateway: internal error in %s: %s (the request, if any, was answered 500)\n", where, what);
}

uint64_t escaped_exceptions() noexcept { return g_escaped.load(std::memory_order_relaxed); }

}  // namespace moe::gw
