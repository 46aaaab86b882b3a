#include "gateway/sched/thermal_governor.h"

namespace moe::gw {

std::string throttle_reason_names(uint64_t reasons) {
  std::string out;
  for (const auto& r : protocol::throttle::kReasons)
    if (reasons & r.bit) {
      if (!out.empty()) out += ',';
      out += r.name;
    }
  return out;
}

bool ThermalGovernor::observe(const protocol::CardHealth& s) {
  if (!s.available) return false;
  // Stats replies may come faster than the card is sampled: one sample counts once.
  if (s.sample_seq != 0 && s.sample_seq == last_seq_) return false;
  last_seq_ = s.sample_seq;
  const uint64_t thermal = s.throttle_reasons & kThermalThrottleReasons;
  if (!hot_) {
    const bool looks_hot = s.temperature_c >= limits_.hot_c || thermal != 0;
    run_ = looks_hot ? run_ + 1 : 0;
    if (run_ < limits_.enter_samples) return false;
    hot_ = true;
    run_ = 0;
    why_ = std::to_string(s.temperature_c) + " °C";
    if (thermal) why_ += ", " + throttle_reason_names(thermal);
    return true;
  }
  const bool looks_cool = s.temperature_c <= limits_.hot_c - limits_.cool_margin_c && thermal == 0;
  run_ = looks_cool ? run_ + 1 : 0;
  if (run_ < limits_.leave_samples) return false;
  hot_ = false;
  run_ = 0;
  why_ = std::to_string(s.temperature_c) + " °C";
  return true;
}

}  // namespace moe::gw
