#pragma once
// The last line of defence of the loop thread: every libuv callback of the
// gateway runs its body through last_resort(), so that an exception nothing
// else caught (a bug, std::bad_alloc) is logged and counted instead of
// ending the process. Whoever owns a client's exchange still answers it
// (500) in its own handler; this only keeps the process alive.

#include <cstdint>
#include <exception>
#include <utility>

namespace moe::gw {

// Logs `where` and the exception's message to stderr, and counts it.
void report_escaped_exception(const char* where, const char* what) noexcept;
// Exceptions caught by last_resort() since the process started.
uint64_t escaped_exceptions() noexcept;

// Runs `fn()`; false when it threw (logged and counted).
template <typename F>
bool last_resort(const char* where, F&& fn) noexcept {
  try {
    std::forward<F>(fn)();
    return true;
  } catch (const std::exception& e) {
    report_escaped_exception(where, e.what());
  } catch (...) {
    report_escaped_exception(where, "an exception of unknown type");
  }
  return false;
}

}  // namespace moe::gw
