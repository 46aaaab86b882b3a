#include "gateway/admission.h"

namespace moe::gw {

AdmissionTicket& AdmissionTicket::operator=(AdmissionTicket&& o) noexcept {
  if (this != &o) {
    release();
    owner_ = o.owner_;
    caller_ = std::move(o.caller_);
    sequences_ = o.sequences_;
    o.owner_ = nullptr;
    o.sequences_ = 0;
  }
  return *this;
}

void AdmissionTicket::release() {
  if (owner_) owner_->give_back(caller_, sequences_);
  owner_ = nullptr;
  sequences_ = 0;
}

std::variant<AdmissionTicket, ApiError> Admission::admit(const std::string& caller, int sequences, int waiting_now) {
  const int mine = in_flight(caller);
  if (mine + sequences > limits_.max_caller_sequences) {
    ++refused_;
    return ApiError{429,
                    "Too many sequences in flight for this caller: " + std::to_string(mine) + " running or waiting, " +
                        std::to_string(sequences) + " more asked, at most " +
                        std::to_string(limits_.max_caller_sequences) + "; retry when some have finished.",
                    "rate_limit_error", "", "too_many_sequences"};
  }
  if (waiting_now + sequences > limits_.max_waiting) {
    ++refused_;
    return ApiError{429,
                    "The server is saturated: " + std::to_string(waiting_now) + " sequences wait already (at most " +
                        std::to_string(limits_.max_waiting) + "); retry shortly.",
                    "rate_limit_error", "", "queue_full"};
  }
  by_caller_[caller] += sequences;
  total_ += sequences;
  AdmissionTicket t;
  t.owner_ = this;
  t.caller_ = caller;
  t.sequences_ = sequences;
  return t;
}

int Admission::in_flight(const std::string& caller) const {
  auto it = by_caller_.find(caller);
  return it == by_caller_.end() ? 0 : it->second;
}

void Admission::give_back(const std::string& caller, int sequences) {
  total_ -= sequences;
  auto it = by_caller_.find(caller);
  if (it == by_caller_.end()) return;
  it->second -= sequences;
  if (it->second <= 0) by_caller_.erase(it);
}

}  // namespace moe::gw
