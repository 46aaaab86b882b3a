#pragma once
// One card as the NVIDIA driver's management library (NVML, libnvidia-ml)
// reports it: the device memory a process holds (as nvidia-smi lists it),
// and the card's health (docs/operations.md): temperature, clocks, power,
// throttle reasons, PCIe throughput. NVML is loaded at run time
// (dlopen("libnvidia-ml.so.1")), so nothing here needs it at build time and
// a machine without the driver runs the same binary: open() says why not.
//
// Users: the CUDA engine measures what its process holds against
// --vram-budget (docs/cuda-worker.md, "What the budget covers"); the worker
// samples the card's health for the gateway's /metrics (health_monitor.h).
// NVML's calls are thread-safe; one NvmlCard may be used from one thread at
// a time.

#include <cstdint>
#include <memory>
#include <string>

#include "model/result.h"
#include "protocol/messages.h"

namespace moe {

class NvmlCard {
 public:
  // The card with this PCI bus id ("0000:3b:00.0", as cudaDeviceGetPCIBusId
  // gives it); empty: NVML's first card. An error when NVML cannot be loaded
  // or does not know the card.
  static Result<std::unique_ptr<NvmlCard>> open(const std::string& pci_bus_id);
  ~NvmlCard();
  NvmlCard(const NvmlCard&) = delete;
  NvmlCard& operator=(const NvmlCard&) = delete;

  // Bytes this process holds on the card, as nvidia-smi lists it; an error
  // when the card does not list this process (a container whose pids the
  // driver does not see).
  Result<uint64_t> process_bytes() const;
  // Bytes in use on the whole card (every process).
  Result<uint64_t> device_used_bytes() const;
  // A fresh health sample (available = true); fields the card does not
  // support stay 0. PCIe throughput blocks ~20 ms: call it off the hot path.
  protocol::CardHealth sample() const;

  struct Api;  // the NVML entry points, resolved by name

 private:
  explicit NvmlCard(std::unique_ptr<Api> api);
  std::unique_ptr<Api> api_;
};

}  // namespace moe
