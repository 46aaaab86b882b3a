#pragma once
// Whether a worker's card runs hot, with hysteresis (docs/operations.md,
// "Easing off a hot card"). Fed every health sample the worker reports;
// while hot the scheduler halves the worker's step token budget and batch.
//
//   hot  after `enter_samples` samples in a row at or above `hot_c`, or with
//        a thermal throttle reason (sw_thermal, hw_thermal, hw_slowdown,
//        hw_power_brake);
//   cool after `leave_samples` samples in a row at or below hot_c −
//        `cool_margin_c` and with no thermal reason.
// sw_power_cap alone does not count: a card at its power limit runs as
// designed. A sample without NVML (available = false) changes nothing, nor
// does the same sample again (CardHealth::sample_seq).
//
// Pure state: no clock, no I/O; loop thread only.

#include <cstdint>
#include <string>

#include "protocol/messages.h"

namespace moe::gw {

struct ThermalLimits {
  int hot_c = 87;
  int cool_margin_c = 5;
  int enter_samples = 2;
  int leave_samples = 10;
};

// The throttle reasons that say the card is too hot (protocol::throttle bits).
constexpr uint64_t kThermalThrottleReasons = protocol::throttle::sw_thermal | protocol::throttle::hw_thermal |
                                             protocol::throttle::hw_slowdown | protocol::throttle::hw_power_brake;

// "hw_slowdown,sw_thermal" for a reasons bitmask ("" for none).
std::string throttle_reason_names(uint64_t reasons);

class ThermalGovernor {
 public:
  explicit ThermalGovernor(ThermalLimits limits = {}) : limits_(limits) {}
  // Feeds one sample; true when the state changed (then hot() says which way).
  bool observe(const protocol::CardHealth& sample);
  bool hot() const { return hot_; }
  // Why it is hot now, or why it last became hot ("91 °C, hw_slowdown").
  const std::string& why() const { return why_; }
  const ThermalLimits& limits() const { return limits_; }

 private:
  ThermalLimits limits_;
  bool hot_ = false;
  int run_ = 0;  // samples in a row that point the other way
  uint64_t last_seq_ = 0;  // the last sample's CardHealth::sample_seq
  std::string why_;
};

}  // namespace moe::gw
