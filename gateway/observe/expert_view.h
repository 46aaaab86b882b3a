#pragma once
// What the /experts page shows (docs/experts-page.md): per worker and MoE
// layer, which experts are resident, how hot each is, which the gateway
// predicted for the prompts it gave that worker, and which were used while
// not resident (missed); with the hit rate, expert bytes per token and
// tokens/s once a second. Fed by the scheduler from the hellos, the step
// replies' expert usage and the stats replies; all of it is on only while a
// page is being watched (a fetch within kWatchMs), so a server nobody
// watches adds nothing to its steps.
//
// Threading: loop thread only.

#include <cstdint>
#include <deque>
#include <span>
#include <string>
#include <vector>

#include "protocol/messages.h"

namespace moe::gw {

class ExpertSet;

class ExpertView {
 public:
  static constexpr uint64_t kWatchMs = 10'000;  // a page fetched this recently is being watched
  static constexpr size_t kSeriesLength = 300;  // seconds of hit rate and bytes kept

  // A worker's map, from its hello: its MoE layers (model layer index of
  // each) and the routed experts per layer. A new hello starts it afresh.
  void set_worker(size_t worker, const std::string& name, const protocol::ExpertLayout& layout);
  void drop_worker(size_t worker);

  // A page asked at `now_ms`; true while one did within kWatchMs.
  void watch(uint64_t now_ms) { watched_ms_ = now_ms; }
  // (The page's fetch and the scheduler read two monotonic clocks in ms: a
  // watch a moment "ahead" of now counts as now.)
  bool watched(uint64_t now_ms) const { return watched_ms_ != 0 && now_ms <= watched_ms_ + kWatchMs; }

  // One step result's expert use on `worker` ([moe layer * n_experts +
  // expert] tokens, as the step reply carries it).
  void on_usage(size_t worker, std::span<const uint16_t> usage);
  // The experts the gateway predicted for a prompt it gave `worker`
  // (bits [moe layer * n_experts + expert]).
  void on_prediction(size_t worker, const ExpertSet& predicted);
  // A stats reply of `worker` at `now_ms`: its resident set (when it was
  // asked for) and counters; closes that worker's second of use and misses.
  void on_stats(size_t worker, const protocol::StatsReply& r, uint64_t now_ms);

  // The page's data: {"workers": [{name, moe_layers, n_experts, resident,
  // predicted, hot, missed, series}], "watch_ms"}. resident and predicted
  // are strings of '0'/'1' per expert, row-major by MoE layer; hot the
  // tokens a second each expert served (a moving average), missed the steps
  // of the last second it was used while not resident.
  std::string json() const;

 private:
  struct Sample {
    uint64_t t_ms = 0;
    double hit_rate = -1;          // -1: no expert was asked for
    double bytes_per_token = 0;    // expert bytes copied and streamed a token run
    double tokens_per_s = 0;
  };
  struct Worker {
    bool present = false;
    std::string name;
    std::vector<uint16_t> moe_layers;
    int n_experts = 0;
    std::vector<uint8_t> resident, predicted, predicted_now;  // [moe layer * n_experts + expert]
    std::vector<float> hot;                                   // tokens a second, a moving average
    std::vector<uint32_t> used_now, missed_now, missed;       // this second's, the last second's
    bool resident_known = false;  // the last stats carried the resident set
    bool have_counters = false;
    protocol::StatsReply last;  // counters at the last stats
    uint64_t last_ms = 0;
    std::deque<Sample> series;
    size_t cells() const { return moe_layers.size() * size_t(n_experts); }
  };
  Worker* worker(size_t w);

  std::vector<Worker> workers_;
  uint64_t watched_ms_ = 0;
};

}  // namespace moe::gw
