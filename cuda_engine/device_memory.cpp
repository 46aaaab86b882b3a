#include "cuda_engine/device_memory.h"

#include <dlfcn.h>
#include <unistd.h>

#include <vector>

namespace moe {

// The few NVML entry points and types used here, as the NVML API documents
// them (stable across drivers; the _v2/_v3 names are the current ones).
namespace {
using nvmlReturn = int;
constexpr nvmlReturn kNvmlSuccess = 0;
constexpr nvmlReturn kNvmlInsufficientSize = 7;
struct nvmlDevice;
using nvmlDevice_t = nvmlDevice*;
struct nvmlProcessInfo {  // nvmlProcessInfo_t (v2 layout)
  unsigned int pid;
  unsigned long long usedGpuMemory;
  unsigned int gpuInstanceId;
  unsigned int computeInstanceId;
};
struct nvmlMemory {  // nvmlMemory_t
  unsigned long long total, free, used;
};
}  // namespace

struct DeviceMemoryMeter::Nvml {
  void* lib = nullptr;
  nvmlDevice_t device = nullptr;
  nvmlReturn (*init)() = nullptr;
  nvmlReturn (*shutdown)() = nullptr;
  nvmlReturn (*by_pci)(const char*, nvmlDevice_t*) = nullptr;
  nvmlReturn (*processes)(nvmlDevice_t, unsigned int*, nvmlProcessInfo*) = nullptr;
  nvmlReturn (*memory)(nvmlDevice_t, nvmlMemory*) = nullptr;
  ~Nvml() {
    if (shutdown) shutdown();
    if (lib) ::dlclose(lib);
  }
};

Result<std::unique_ptr<DeviceMemoryMeter>> DeviceMemoryMeter::open(const std::string& pci_bus_id) {
  auto n = std::make_unique<Nvml>();
  n->lib = ::dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
  if (!n->lib) return make_error("NVML (libnvidia-ml.so.1) cannot be loaded");
  auto sym = [&](const char* name) { return ::dlsym(n->lib, name); };
  n->init = reinterpret_cast<nvmlReturn (*)()>(sym("nvmlInit_v2"));
  n->shutdown = reinterpret_cast<nvmlReturn (*)()>(sym("nvmlShutdown"));
  n->by_pci = reinterpret_cast<nvmlReturn (*)(const char*, nvmlDevice_t*)>(sym("nvmlDeviceGetHandleByPciBusId_v2"));
  n->processes = reinterpret_cast<nvmlReturn (*)(nvmlDevice_t, unsigned int*, nvmlProcessInfo*)>(
      sym("nvmlDeviceGetComputeRunningProcesses_v3"));
  n->memory = reinterpret_cast<nvmlReturn (*)(nvmlDevice_t, nvmlMemory*)>(sym("nvmlDeviceGetMemoryInfo"));
  if (!n->init || !n->shutdown || !n->by_pci || !n->processes || !n->memory)
    return make_error("NVML lacks the functions needed");
  if (n->init() != kNvmlSuccess) {
    n->shutdown = nullptr;
    return make_error("NVML does not start");
  }
  if (n->by_pci(pci_bus_id.c_str(), &n->device) != kNvmlSuccess)
    return make_error("NVML does not know the device " + pci_bus_id);
  return std::unique_ptr<DeviceMemoryMeter>(new DeviceMemoryMeter(std::move(n)));
}

DeviceMemoryMeter::DeviceMemoryMeter(std::unique_ptr<Nvml> nvml) : nvml_(std::move(nvml)) {}
DeviceMemoryMeter::~DeviceMemoryMeter() = default;

Result<uint64_t> DeviceMemoryMeter::process_bytes() const {
  std::vector<nvmlProcessInfo> infos(16);
  for (int attempt = 0; attempt < 4; ++attempt) {
    unsigned int count = unsigned(infos.size());
    const nvmlReturn r = nvml_->processes(nvml_->device, &count, infos.data());
    if (r == kNvmlInsufficientSize) {
      infos.resize(size_t(count) + 16);
      continue;
    }
    if (r != kNvmlSuccess) return make_error("NVML: the device's processes cannot be read (" + std::to_string(r) + ")");
    const unsigned int me = unsigned(::getpid());
    for (unsigned int i = 0; i < count; ++i)
      if (infos[i].pid == me) return uint64_t(infos[i].usedGpuMemory);
    return make_error("NVML does not list this process on the device");
  }
  return make_error("NVML: the process list keeps growing");
}

Result<uint64_t> DeviceMemoryMeter::device_used_bytes() const {
  nvmlMemory m{};
  const nvmlReturn r = nvml_->memory(nvml_->device, &m);
  if (r != kNvmlSuccess) return make_error("NVML: the device's memory cannot be read (" + std::to_string(r) + ")");
  return uint64_t(m.used);
}

}  // namespace moe
