#pragma once
// The device side of memory islands: the one cudaMalloc arena of the VRAM
// budget, carved per an IslandPlan; pinned host copies of every expert blob;
// a copy stream whose host-to-device copies into islands are ordered against
// the compute stream with events. The ResidencyMap decides what goes where;
// this class moves the bytes (docs/memory-islands.md).
//
// Ordering, per island: a copy waits until the compute work that last read
// the island's previous expert has run (release), and compute that reads the
// island waits until its copy has landed (request) — so copies overlap
// compute without a read ever seeing half a blob.
//
// No device allocation happens after create(). Threads: the step thread only,
// like the map it serves. Built only with the CUDA toolkit; this header does
// not need the CUDA headers.

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "residency/island_plan.h"
#include "residency/residency.h"
#include "model/result.h"

struct CUstream_st;
struct CUevent_st;

namespace moe {

using GpuStream = CUstream_st*;  // a cudaStream_t

// Where the experts live on the host: blob of (layer, expert) at
// blobs[layer * n_experts + expert], each blob_bytes long (for a packed file,
// ModelFiles::expert_q4 pointers into its mapping).
struct ExpertHostSource {
  int n_layers = 0;
  int n_experts = 0;
  size_t blob_bytes = 0;
  std::vector<const uint8_t*> blobs;
  // Set when every blob lies in this page-locked, mapped block (experts
  // quantised at load): the arena uses it as it is. The owner frees it.
  const uint8_t* pinned_base = nullptr;
};

class IslandArena {
 public:
  // Allocates plan.arena_bytes on the current device, pins the host blobs
  // (uses them as they are when the source says they are page-locked,
  // registers their memory in place when they form one range, else copies
  // them into page-locked memory), creates the copy stream and the events.
  [[nodiscard]] static Result<std::unique_ptr<IslandArena>> create(const IslandPlan& plan,
                                                                   const ExpertHostSource& src);
  ~IslandArena();
  IslandArena(const IslandArena&) = delete;
  IslandArena& operator=(const IslandArena&) = delete;

  // ---- The arena
  const IslandPlan& plan() const { return plan_; }
  uint8_t* base() const { return base_; }
  uint8_t* region(const ArenaRegion& r) const { return base_ + r.offset; }
  uint8_t* island(int64_t i) const { return base_ + plan_.island_offset(i); }
  // True when the host blobs were pinned where they lie (no second copy in RAM).
  bool host_registered() const { return registered_base_ != nullptr; }
  GpuStream copy_stream() const { return copy_stream_; }
  uint64_t copies() const { return copies_; }

  // ---- Per step
  // Makes (layer, expert) resident through `map` (pinning it) and returns its
  // device blob. A miss enqueues the copy; either way `compute` waits for the
  // island's last copy (a hit may be a prefetch still in flight).
  [[nodiscard]] Result<const uint8_t*> request(ResidencyMap& map, int layer, int expert,
                                               GpuStream compute);
  // Hints `layer`'s likely experts to the map and enqueues the copies it
  // decides; nothing waits for them until they are requested.
  [[nodiscard]] Status prefetch(ResidencyMap& map, int layer, std::span<const int> experts,
                                HintPriority priority);
  // The work enqueued on `compute` so far is the last reader of the expert's
  // island for now: records that, and unpins it in the map.
  [[nodiscard]] Status release(ResidencyMap& map, int layer, int expert, GpuStream compute);
  // The pinned host copy of an expert's blob (what a copy reads; the host
  // computes a miss from it when the engine splits misses).
  const uint8_t* host_blob(ExpertKey k) const;
  // The same blob's address for a kernel (mapped pinned memory): a streamed
  // miss is read through it, over the link, without a copy.
  const uint8_t* host_blob_on_device(ExpertKey k) const;
  // Copies an admitted expert (ResidencyMap::admit) into its island, after
  // the compute that last read the island.
  [[nodiscard]] Status load(const Placement& p);
  // `compute` waits until the last copy into `island` has landed.
  [[nodiscard]] Status wait_copied(int64_t island, GpuStream compute);
  // Waits until every copy enqueued so far has finished.
  [[nodiscard]] Status synchronize();

 private:
  IslandArena() = default;
  Status copy_into(const Placement& p);

  IslandPlan plan_;
  int n_experts_ = 0;
  uint8_t* base_ = nullptr;  // device arena
  GpuStream copy_stream_ = nullptr;
  std::vector<CUevent_st*> copied_;     // [island] the last copy into it
  std::vector<CUevent_st*> read_done_;  // [island] the last compute that read it
  std::vector<const uint8_t*> host_;    // [layer * n_experts + expert] pinned blob
  std::vector<const uint8_t*> host_dev_;  // the same, as the device addresses it
  void* registered_base_ = nullptr;     // cudaHostRegister'ed range, or null
  uint8_t* staging_ = nullptr;          // cudaMallocHost copy when registering failed
  uint64_t copies_ = 0;
};

}  // namespace moe
