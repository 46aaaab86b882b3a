#pragma once
// Samples one card's health (nvml_card.h) on a thread of its own, once a
// period, so that no query (PCIe throughput blocks ~20 ms) ever stalls a
// step; latest() copies the last sample and is safe from any thread. Without
// NVML every sample says why not (available = false, `reason`).

#include <chrono>
#include <condition_variable>
#include <mutex>
#include <string>
#include <thread>

#include "protocol/messages.h"

namespace moe {

class CardHealthMonitor {
 public:
  // Starts sampling the card with this PCI bus id ("": NVML's first card).
  explicit CardHealthMonitor(std::string pci_bus_id,
                             std::chrono::milliseconds period = std::chrono::milliseconds(1000));
  ~CardHealthMonitor();
  CardHealthMonitor(const CardHealthMonitor&) = delete;
  CardHealthMonitor& operator=(const CardHealthMonitor&) = delete;

  // The last sample, its age filled in.
  protocol::CardHealth latest() const;
  // Waits until the first sample (or the reason there is none) is in.
  void wait_first() const;

 private:
  void run();

  const std::string pci_bus_id_;
  const std::chrono::milliseconds period_;
  mutable std::mutex mu_;
  mutable std::condition_variable cv_;
  bool stop_ = false;
  bool sampled_ = false;
  uint64_t samples_ = 0;
  protocol::CardHealth last_;
  std::chrono::steady_clock::time_point last_at_{};
  std::thread thread_;
};

}  // namespace moe
