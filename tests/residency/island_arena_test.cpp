// IslandArena on a real device: blobs land intact in their islands, and the
// event ordering holds when many requests, evictions and reads are enqueued
// without any host synchronisation in between. Skipped (with a warning)
// where no CUDA device is present.
#include "residency/island_arena.h"

#include <cuda_runtime.h>

#include <catch2/catch.hpp>
#include <cstring>
#include <random>

#include "kernels/cuda/cuda_check.cuh"

using namespace moe;

namespace {

constexpr int kLayers = 3, kExperts = 8;
constexpr size_t kBlob = 4000;  // not a multiple of 256: islands are padded

IslandPlan small_plan(int64_t islands) {
  IslandPlanRequest r;
  r.budget_bytes = size_t(1) << 24;
  r.nonexpert_bytes = 10000;
  r.kv_bytes_per_block = 3000;
  r.kv_blocks_wanted = r.kv_blocks_min = 4;
  r.workspace_bytes = 5000;
  r.expert_blob_bytes = kBlob;
  r.n_total_experts = islands;  // caps the islands at exactly this many
  r.min_islands = 4;
  auto p = plan_islands(r);
  REQUIRE(p.ok());
  REQUIRE(p->n_islands == islands);
  return *p;
}

// Each blob's bytes name its expert, so a wrong or torn copy shows.
void fill_blob(uint8_t* b, int layer, int expert) {
  for (size_t j = 0; j < kBlob; ++j) b[j] = uint8_t((layer * 131 + expert * 17 + j * 7) & 0xff);
}

void run_workload(IslandArena& arena, const ExpertHostSource& src) {
  ResidencyMap map(kLayers, kExperts, arena.plan().n_islands, kBlob, std::make_unique<LruPolicy>());
  cudaStream_t compute = nullptr;
  REQUIRE(cudaStreamCreate(&compute) == cudaSuccess);
  std::mt19937 rng(5);
  const int kReads = 600;
  std::vector<uint8_t> seen(size_t(kReads) * kBlob);
  std::vector<ExpertKey> which(kReads);
  // Pinned readback so the device-to-host copies stay asynchronous.
  uint8_t* readback = nullptr;
  REQUIRE(cudaMallocHost(reinterpret_cast<void**>(&readback), seen.size()) == cudaSuccess);
  for (int r = 0; r < kReads; r += 2) {
    const int layer = r / 2 % kLayers;
    const int e1 = int(rng() % kExperts), e2 = (e1 + 1 + int(rng() % (kExperts - 1))) % kExperts;
    if (rng() % 3 == 0) {  // a prefetch of the next layer, overlapping this one
      const std::vector<int> guess{int(rng() % kExperts)};
      REQUIRE(arena.prefetch(map, (layer + 1) % kLayers, guess, HintPriority::prefetch).ok());
    }
    for (int k = 0; k < 2; ++k) {
      const int e = k ? e2 : e1;
      auto dev = arena.request(map, layer, e, compute);
      REQUIRE(dev.ok());
      which[size_t(r + k)] = {layer, e};
      // The "compute": read the island on the compute stream.
      REQUIRE(cudaMemcpyAsync(readback + size_t(r + k) * kBlob, *dev, kBlob, cudaMemcpyDeviceToHost,
                              compute) == cudaSuccess);
    }
    map.clear_predictions(layer);
    for (int e : {e1, e2}) REQUIRE(arena.release(map, layer, e, compute).ok());
  }
  REQUIRE(cudaStreamSynchronize(compute) == cudaSuccess);
  REQUIRE(arena.synchronize().ok());
  std::memcpy(seen.data(), readback, seen.size());
  for (int r = 0; r < kReads; ++r) {
    const uint8_t* want =
        src.blobs[size_t(which[size_t(r)].layer * kExperts + which[size_t(r)].expert)];
    INFO("read " << r << " layer " << which[size_t(r)].layer << " expert "
                 << which[size_t(r)].expert);
    REQUIRE(std::memcmp(seen.data() + size_t(r) * kBlob, want, kBlob) == 0);
  }
  CHECK(map.stats().evictions > 100);
  CHECK(arena.copies() == map.stats().misses + map.stats().prefetches);
  cudaFreeHost(readback);
  cudaStreamDestroy(compute);
}

}  // namespace

TEST_CASE("island arena: contiguous host blobs, reads always see the requested expert") {
  if (!cuda::device_present()) {
    WARN("no CUDA device: island arena test skipped");
    return;
  }
  std::vector<uint8_t> host(size_t(kLayers) * kExperts * kBlob);
  ExpertHostSource src{kLayers, kExperts, kBlob, {}};
  for (int l = 0; l < kLayers; ++l)
    for (int e = 0; e < kExperts; ++e) {
      uint8_t* b = host.data() + size_t(l * kExperts + e) * kBlob;
      fill_blob(b, l, e);
      src.blobs.push_back(b);
    }
  const IslandPlan plan = small_plan(5);
  auto arena = IslandArena::create(plan, src);
  REQUIRE(arena.ok());
  IslandArena& a = **arena;
  CHECK(reinterpret_cast<uintptr_t>(a.base()) % 256 == 0);
  CHECK(a.island(1) - a.island(0) == ptrdiff_t(plan.island_stride));
  CHECK(a.region(plan.kv) == a.base() + plan.kv.offset);
  run_workload(a, src);
}

TEST_CASE("island arena: scattered host blobs go through a page-locked copy") {
  if (!cuda::device_present()) {
    WARN("no CUDA device: island arena test skipped");
    return;
  }
  // Far apart: one heap block per blob with large gaps between them.
  std::vector<std::vector<uint8_t>> blocks;
  ExpertHostSource src{kLayers, kExperts, kBlob, {}};
  for (int l = 0; l < kLayers; ++l)
    for (int e = 0; e < kExperts; ++e) {
      blocks.emplace_back(kBlob * 8);
      uint8_t* b = blocks.back().data() + kBlob * 3;
      fill_blob(b, l, e);
      src.blobs.push_back(b);
    }
  auto arena = IslandArena::create(small_plan(4), src);
  REQUIRE(arena.ok());
  CHECK_FALSE((*arena)->host_registered());
  run_workload(**arena, src);
}

TEST_CASE("island arena: refuses blobs that do not match the plan") {
  if (!cuda::device_present()) {
    WARN("no CUDA device: island arena test skipped");
    return;
  }
  std::vector<uint8_t> host(kBlob * 2);
  ExpertHostSource src{1, 2, kBlob + 1, {host.data(), host.data() + kBlob}};
  CHECK_FALSE(IslandArena::create(small_plan(4), src).ok());
  src.blob_bytes = kBlob;
  src.n_experts = 3;  // 3 expected, 2 given
  CHECK_FALSE(IslandArena::create(small_plan(4), src).ok());
}
