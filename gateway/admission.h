#pragma once
// Admission control in front of the scheduler: how many sequences (choices)
// one caller may have in flight (waiting or running), and how many may wait
// in the scheduler altogether. A request that would pass either bound is
// refused at once with 429 and Retry-After, before anything is queued, so
// one client queuing thousands of sequences cannot starve everyone else.
// Among what is admitted, the scheduler starts sequences round-robin across
// requests (docs/scheduler.md).
//
// A caller is the API key it authenticated with, or, without keys, its
// client address.
//
// Threading: loop thread only.

#include <cstdint>
#include <string>
#include <unordered_map>
#include <variant>

#include "gateway/api_error.h"

namespace moe::gw {

struct AdmissionLimits {
  int max_caller_sequences = 256;  // per caller, waiting or running
  int max_waiting = 1024;          // waiting in the scheduler, every caller together
  int retry_after_s = 1;           // the Retry-After of a refusal
};

class Admission;

// A caller's admitted sequences; gives them back when released (or destroyed).
class AdmissionTicket {
 public:
  AdmissionTicket() = default;
  AdmissionTicket(AdmissionTicket&& o) noexcept { *this = std::move(o); }
  AdmissionTicket& operator=(AdmissionTicket&& o) noexcept;
  AdmissionTicket(const AdmissionTicket&) = delete;
  AdmissionTicket& operator=(const AdmissionTicket&) = delete;
  ~AdmissionTicket() { release(); }
  void release();

 private:
  friend class Admission;
  Admission* owner_ = nullptr;
  std::string caller_;
  int sequences_ = 0;
};

class Admission {
 public:
  explicit Admission(AdmissionLimits limits) : limits_(limits) {}
  // `waiting_now`: sequences the scheduler holds that are not yet running.
  // A 429 ApiError (with its Retry-After in retry_after_s()) or a ticket.
  std::variant<AdmissionTicket, ApiError> admit(const std::string& caller, int sequences, int waiting_now);

  int in_flight(const std::string& caller) const;
  int in_flight() const { return total_; }
  size_t callers() const { return by_caller_.size(); }
  const AdmissionLimits& limits() const { return limits_; }
  uint64_t refused() const { return refused_; }

 private:
  friend class AdmissionTicket;
  void give_back(const std::string& caller, int sequences);

  AdmissionLimits limits_;
  std::unordered_map<std::string, int> by_caller_;
  int total_ = 0;
  uint64_t refused_ = 0;
};

}  // namespace moe::gw
