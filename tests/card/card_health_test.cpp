// NvmlCard and CardHealthMonitor on whatever machine runs the tests: without
// the NVIDIA driver (CI) every sample says why not; with it (the GPU
// machine) the samples are real and plausible.
#include <catch2/catch.hpp>

#include <chrono>
#include <cstdio>
#include <thread>

#include "card/health_monitor.h"
#include "card/nvml_card.h"

using moe::CardHealthMonitor;
using moe::NvmlCard;

TEST_CASE("the card's health: unavailable with the reason, or real samples", "[card]") {
  auto card = NvmlCard::open("");
  CardHealthMonitor mon("", std::chrono::milliseconds(100));
  mon.wait_first();
  const moe::protocol::CardHealth h = mon.latest();
  if (!card) {
    std::printf("no NVML here (%s): checking what is reported without it\n", card.error().c_str());
    CHECK_FALSE(h.available);
    CHECK_THAT(h.reason, Catch::Contains("NVML"));
    CHECK(h.temperature_c == 0);
    // It stays so; nothing is retried in a loop.
    std::this_thread::sleep_for(std::chrono::milliseconds(250));
    CHECK_FALSE(mon.latest().available);
    return;
  }
  std::printf("NVML: %s, %d C, SM %u of %u MHz, memory %u MHz, %.1f of %.1f W, throttle 0x%llx, "
              "process %.1f MiB of %.1f GiB, PCIe tx %u rx %u KB/s\n",
              h.name.c_str(), h.temperature_c, h.sm_clock_mhz, h.sm_clock_max_mhz, h.memory_clock_mhz,
              h.power_mw / 1000.0, h.power_limit_mw / 1000.0, (unsigned long long)h.throttle_reasons,
              h.process_memory_bytes / 1048576.0, h.memory_total_bytes / 1073741824.0, h.pcie_tx_kbps,
              h.pcie_rx_kbps);
  REQUIRE(h.available);
  CHECK_FALSE(h.name.empty());
  CHECK(h.temperature_c > 0);
  CHECK(h.temperature_c < 120);
  CHECK(h.sm_clock_max_mhz > 0);
  CHECK(h.sm_clock_mhz <= h.sm_clock_max_mhz);
  CHECK(h.memory_clock_mhz > 0);
  CHECK(h.power_mw > 0);
  CHECK(h.power_limit_mw >= 10'000);
  CHECK(h.memory_total_bytes > (uint64_t(1) << 30));
  // Sampled again a period later.
  const uint32_t age0 = mon.latest().sample_age_ms;
  std::this_thread::sleep_for(std::chrono::milliseconds(350));
  CHECK(mon.latest().sample_age_ms < 350);
  CHECK(age0 < 1000);
  CHECK((*card)->device_used_bytes().ok());
}

TEST_CASE("a card NVML does not know is an error that names it", "[card]") {
  auto card = NvmlCard::open("0000:ff:1f.7");
  REQUIRE_FALSE(card.ok());
  CHECK_THAT(card.error(), Catch::Contains("NVML"));
  CardHealthMonitor mon("0000:ff:1f.7");
  mon.wait_first();
  CHECK_FALSE(mon.latest().available);
  CHECK_FALSE(mon.latest().reason.empty());
}
