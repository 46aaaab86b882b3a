#include "card/nvml_card.h"

#include <dlfcn.h>
#include <unistd.h>

#include <vector>

namespace moe {
namespace {

// The few NVML types used here, as the library's ABI has them (nvmlReturn_t
// is an int enum, 0 success; the _v2/_v3 entry points are the current ones).
using Ret = int;
struct DeviceTag;
using Device = DeviceTag*;
constexpr Ret kSuccess = 0;
constexpr Ret kInsufficientSize = 7;
constexpr int kTemperatureGpu = 0;
constexpr int kClockSm = 1, kClockMem = 2;
constexpr int kPcieTx = 0, kPcieRx = 1;
constexpr unsigned long long kValueNotAvailable = ~0ULL;

struct Memory {  // nvmlMemory_t
  unsigned long long total, free, used;
};
struct ProcessInfo {  // nvmlProcessInfo_t as the _v2/_v3 process lists fill it
  unsigned int pid;
  unsigned long long used_memory;
  unsigned int gpu_instance_id;
  unsigned int compute_instance_id;
};

}  // namespace

struct NvmlCard::Api {
  void* lib = nullptr;
  Device device = nullptr;
  std::string name;
  Ret (*init)() = nullptr;
  Ret (*shutdown)() = nullptr;
  const char* (*error_string)(Ret) = nullptr;
  Ret (*by_bus_id)(const char*, Device*) = nullptr;
  Ret (*by_index)(unsigned, Device*) = nullptr;
  Ret (*get_name)(Device, char*, unsigned) = nullptr;
  Ret (*temperature)(Device, int, unsigned*) = nullptr;
  Ret (*clock)(Device, int, unsigned*) = nullptr;
  Ret (*max_clock)(Device, int, unsigned*) = nullptr;
  Ret (*power)(Device, unsigned*) = nullptr;
  Ret (*power_limit)(Device, unsigned*) = nullptr;
  Ret (*throttle)(Device, unsigned long long*) = nullptr;
  Ret (*memory)(Device, Memory*) = nullptr;
  Ret (*processes)(Device, unsigned*, ProcessInfo*) = nullptr;
  Ret (*pcie)(Device, int, unsigned*) = nullptr;
  bool started = false;

  template <typename F>
  void bind(F& f, const char* symbol) {
    if (!f) f = reinterpret_cast<F>(::dlsym(lib, symbol));
  }
  std::string error(Ret r) const {
    const char* s = error_string ? error_string(r) : nullptr;
    return s ? std::string(s) : "NVML error " + std::to_string(r);
  }
  ~Api() {
    if (started) shutdown();
    if (lib) ::dlclose(lib);
  }
};

Result<std::unique_ptr<NvmlCard>> NvmlCard::open(const std::string& pci_bus_id) {
  auto a = std::make_unique<Api>();
  a->lib = ::dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
  if (!a->lib) return make_error("NVML (libnvidia-ml.so.1, the NVIDIA driver's) cannot be loaded");
  a->bind(a->init, "nvmlInit_v2");
  a->bind(a->shutdown, "nvmlShutdown");
  a->bind(a->error_string, "nvmlErrorString");
  a->bind(a->by_bus_id, "nvmlDeviceGetHandleByPciBusId_v2");
  a->bind(a->by_index, "nvmlDeviceGetHandleByIndex_v2");
  a->bind(a->get_name, "nvmlDeviceGetName");
  a->bind(a->temperature, "nvmlDeviceGetTemperature");
  a->bind(a->clock, "nvmlDeviceGetClockInfo");
  a->bind(a->max_clock, "nvmlDeviceGetMaxClockInfo");
  a->bind(a->power, "nvmlDeviceGetPowerUsage");
  a->bind(a->power_limit, "nvmlDeviceGetEnforcedPowerLimit");
  // Renamed "clocks event reasons" by newer drivers, which keep the old name.
  a->bind(a->throttle, "nvmlDeviceGetCurrentClocksEventReasons");
  a->bind(a->throttle, "nvmlDeviceGetCurrentClocksThrottleReasons");
  a->bind(a->memory, "nvmlDeviceGetMemoryInfo");
  a->bind(a->processes, "nvmlDeviceGetComputeRunningProcesses_v3");
  a->bind(a->processes, "nvmlDeviceGetComputeRunningProcesses_v2");
  a->bind(a->pcie, "nvmlDeviceGetPcieThroughput");
  if (!a->init || !a->shutdown || !a->by_bus_id || !a->by_index || !a->processes || !a->memory)
    return make_error("NVML lacks the functions needed");
  if (Ret r = a->init(); r != kSuccess) return make_error("NVML does not start: " + a->error(r));
  a->started = true;
  const Ret r = pci_bus_id.empty() ? a->by_index(0, &a->device) : a->by_bus_id(pci_bus_id.c_str(), &a->device);
  if (r != kSuccess)
    return make_error("NVML does not know the device " + (pci_bus_id.empty() ? std::string("0") : pci_bus_id) +
                      ": " + a->error(r));
  char name[96] = {0};
  if (a->get_name && a->get_name(a->device, name, sizeof name) == kSuccess) a->name = name;
  return std::unique_ptr<NvmlCard>(new NvmlCard(std::move(a)));
}

NvmlCard::NvmlCard(std::unique_ptr<Api> api) : api_(std::move(api)) {}
NvmlCard::~NvmlCard() = default;

Result<uint64_t> NvmlCard::process_bytes() const {
  std::vector<ProcessInfo> infos(16);
  for (int attempt = 0; attempt < 4; ++attempt) {
    unsigned int count = unsigned(infos.size());
    const Ret r = api_->processes(api_->device, &count, infos.data());
    if (r == kInsufficientSize) {
      infos.resize(size_t(count) + 16);
      continue;
    }
    if (r != kSuccess) return make_error("NVML: the device's processes cannot be read: " + api_->error(r));
    const unsigned int me = unsigned(::getpid());
    for (unsigned int i = 0; i < count && i < infos.size(); ++i)
      if (infos[i].pid == me && infos[i].used_memory != kValueNotAvailable) return uint64_t(infos[i].used_memory);
    return make_error("NVML does not list this process on the device");
  }
  return make_error("NVML: the process list keeps growing");
}

Result<uint64_t> NvmlCard::device_used_bytes() const {
  Memory m{};
  const Ret r = api_->memory(api_->device, &m);
  if (r != kSuccess) return make_error("NVML: the device's memory cannot be read: " + api_->error(r));
  return uint64_t(m.used);
}

protocol::CardHealth NvmlCard::sample() const {
  const Api& a = *api_;
  protocol::CardHealth h;
  h.available = true;
  h.name = a.name;
  unsigned v = 0;
  if (a.temperature && a.temperature(a.device, kTemperatureGpu, &v) == kSuccess) h.temperature_c = int32_t(v);
  if (a.clock && a.clock(a.device, kClockSm, &v) == kSuccess) h.sm_clock_mhz = v;
  if (a.clock && a.clock(a.device, kClockMem, &v) == kSuccess) h.memory_clock_mhz = v;
  if (a.max_clock && a.max_clock(a.device, kClockSm, &v) == kSuccess) h.sm_clock_max_mhz = v;
  if (a.power && a.power(a.device, &v) == kSuccess) h.power_mw = v;
  if (a.power_limit && a.power_limit(a.device, &v) == kSuccess) h.power_limit_mw = v;
  unsigned long long reasons = 0;
  if (a.throttle && a.throttle(a.device, &reasons) == kSuccess) h.throttle_reasons = reasons;
  Memory m{};
  const bool have_memory = a.memory(a.device, &m) == kSuccess;
  if (have_memory) h.memory_total_bytes = m.total;
  // This process's share; where the driver lists no processes (a container
  // without the host's pid namespace), the card's whole use.
  if (auto b = process_bytes())
    h.process_memory_bytes = *b;
  else if (have_memory)
    h.process_memory_bytes = m.used;
  if (a.pcie && a.pcie(a.device, kPcieTx, &v) == kSuccess) h.pcie_tx_kbps = v;
  if (a.pcie && a.pcie(a.device, kPcieRx, &v) == kSuccess) h.pcie_rx_kbps = v;
  return h;
}

}  // namespace moe
