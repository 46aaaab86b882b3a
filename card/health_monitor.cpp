#include "card/health_monitor.h"

#include "card/nvml_card.h"

namespace moe {

CardHealthMonitor::CardHealthMonitor(std::string pci_bus_id, std::chrono::milliseconds period)
    : pci_bus_id_(std::move(pci_bus_id)), period_(period) {
  last_.reason = "not sampled yet";
  thread_ = std::thread([this] { run(); });
}

CardHealthMonitor::~CardHealthMonitor() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

protocol::CardHealth CardHealthMonitor::latest() const {
  std::lock_guard<std::mutex> lk(mu_);
  protocol::CardHealth h = last_;
  if (sampled_)
    h.sample_age_ms = uint32_t(
        std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - last_at_).count());
  return h;
}

void CardHealthMonitor::wait_first() const {
  std::unique_lock<std::mutex> lk(mu_);
  cv_.wait(lk, [this] { return sampled_; });
}

void CardHealthMonitor::run() {
  auto card = NvmlCard::open(pci_bus_id_);
  std::unique_lock<std::mutex> lk(mu_);
  if (!card) {
    last_ = {};
    last_.reason = card.error();
    last_at_ = std::chrono::steady_clock::now();
    sampled_ = true;
    cv_.notify_all();
    return;  // nothing to sample, ever
  }
  while (!stop_) {
    lk.unlock();
    protocol::CardHealth h = (*card)->sample();
    lk.lock();
    h.sample_seq = ++samples_;
    last_ = std::move(h);
    last_at_ = std::chrono::steady_clock::now();
    sampled_ = true;
    cv_.notify_all();
    cv_.wait_for(lk, period_, [this] { return stop_; });
  }
}

}  // namespace moe
