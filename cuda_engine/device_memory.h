#pragma once
// What the device holds for this process, as nvidia-smi shows it: the CUDA
// context, the modules loaded into it, cuBLASLt's state, CUDA graphs and the
// arena together. Read through NVML, which the driver ships (libnvidia-ml),
// loaded at run time so that nothing here needs it at build time; without it
// (a driver-less build machine) open() says so and the caller keeps a fixed
// reserve instead.
//
// The CUDA engine measures the process after the context and everything but
// the arena exist, gives the arena what is left of --vram-budget, and checks
// after its warm-up and now and then while serving that nothing was
// allocated since (docs/cuda-worker.md, "What the budget covers").

#include <cstdint>
#include <memory>
#include <string>

#include "model/result.h"

namespace moe {

class DeviceMemoryMeter {
 public:
  // The device with this PCI bus id ("0000:3b:00.0", as
  // cudaDeviceGetPCIBusId gives it). An error when NVML cannot be loaded or
  // does not know the device.
  static Result<std::unique_ptr<DeviceMemoryMeter>> open(const std::string& pci_bus_id);
  ~DeviceMemoryMeter();
  DeviceMemoryMeter(const DeviceMemoryMeter&) = delete;
  DeviceMemoryMeter& operator=(const DeviceMemoryMeter&) = delete;

  // Bytes this process holds on the device, as nvidia-smi lists it; an
  // error when the device does not list this process (a container whose
  // pids the driver does not see).
  Result<uint64_t> process_bytes() const;
  // Bytes in use on the whole device (every process).
  Result<uint64_t> device_used_bytes() const;

 private:
  struct Nvml;
  explicit DeviceMemoryMeter(std::unique_ptr<Nvml> nvml);
  std::unique_ptr<Nvml> nvml_;
};

}  // namespace moe
