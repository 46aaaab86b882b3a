#pragma once
// The gateway's Prometheus metrics (text exposition format 0.0.4). Counters
// and histograms are kept here; gauges of the engine side (queue depth, KV
// blocks, preemptions, degraded) are read from SchedulerStats when rendered.
//
// Threading: loop thread only.

#include <array>
#include <cstdint>
#include <map>
#include <string>
#include <utility>

#include "gateway/sched/scheduler.h"

namespace moe::gw {

// A cumulative histogram over fixed bucket bounds, in seconds.
class LatencyHistogram {
 public:
  static constexpr std::array<double, 14> kBounds = {0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
                                                     0.25,  0.5,    1.0,   2.5,  5.0,   10.0, 30.0};
  void observe(double seconds);
  void render(std::string& out, const char* name, const char* help) const;
  uint64_t count() const { return count_; }

 private:
  std::array<uint64_t, kBounds.size()> buckets_{};  // not cumulative; summed when rendered
  uint64_t count_ = 0;
  double sum_ = 0.0;
};

// What the gateway itself holds right now: the gauges that show a leak or a
// flood (docs/security.md), filled by whoever renders the metrics.
struct GatewayGauges {
  size_t connections = 0;              // open HTTP connections
  uint64_t connections_refused = 0;    // answered 503 past --max-connections
  int sequences_admitted = 0;          // in flight, every caller
  size_t callers = 0;                  // callers with sequences in flight
  uint64_t admission_refused = 0;      // requests answered 429
  size_t generations = 0;              // requests being generated or answered
  size_t held_response_bytes = 0;      // what whole responses hold together (--max-held-response-bytes)
  uint64_t held_responses_refused = 0;  // responses failed 503 past that bound
  size_t sessions_in_memory = 0;       // the session store's mirror
  size_t session_memory_bytes = 0;
  uint64_t internal_errors = 0;        // exceptions the last resort caught
  uint64_t overload_fallback = 0;      // requests sent to the fallback by overload
  uint64_t overload_refused = 0;       // requests refused by overload (429)
  uint64_t rate_limited = 0;           // requests refused by their key's rate limit (429)
  uint64_t reading_refused = 0;        // refused past the caller's share of the parse queue (429)
  uint64_t replayed = 0;               // retried session turns answered from the store
};

class GatewayMetrics {
 public:
  // One finished HTTP exchange (for a stream: counted when its head is sent).
  void count_request(const std::string& endpoint, int status);
  void add_prompt_tokens(uint64_t n) { prompt_tokens_ += n; }
  void add_cached_prompt_tokens(uint64_t n) { cached_prompt_tokens_ += n; }
  void add_completion_tokens(uint64_t n) { completion_tokens_ += n; }
  void observe_ttft(double seconds) { ttft_.observe(seconds); }
  void observe_itl(double seconds) { itl_.observe(seconds); }
  void count_disconnect() { ++client_disconnects_; }
  void count_degraded_response() { ++degraded_responses_; }

  uint64_t requests(const std::string& endpoint, int status) const;

  // The whole exposition text.
  std::string render(const SchedulerStats& stats, bool ready, const GatewayGauges& gauges = {}) const;

 private:
  std::map<std::pair<std::string, int>, uint64_t> requests_;  // (endpoint, status) → count
  uint64_t prompt_tokens_ = 0;
  uint64_t cached_prompt_tokens_ = 0;
  uint64_t completion_tokens_ = 0;
  uint64_t client_disconnects_ = 0;
  uint64_t degraded_responses_ = 0;
  LatencyHistogram ttft_;
  LatencyHistogram itl_;
};

}  // namespace moe::gw
