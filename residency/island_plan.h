#pragma once
// The carve-up of the one device arena the worker allocates at start-up:
// non-expert weights, the KV pool (fixed-size blocks), a workspace, and
// equal-size expert islands (docs/memory-islands.md). Pure arithmetic, no
// CUDA: the worker plans first and allocates once from the plan.

#include <cstddef>
#include <cstdint>
#include <string>

#include "model/result.h"

namespace moe {

struct IslandPlanRequest {
  size_t budget_bytes = 0;        // --vram-budget: the whole arena may not exceed it
  size_t nonexpert_bytes = 0;     // embeddings, attention, norms, router, shared experts
  size_t kv_bytes_per_block = 0;  // one KV block, all layers
  int64_t kv_blocks_wanted = 0;   // honoured before extra islands (the operator asked)
  int64_t kv_blocks_min = 0;      // below this the worker refuses to start
  size_t workspace_bytes = 0;     // activations, scratch of the kernels
  size_t expert_blob_bytes = 0;   // ExpertLayout::blob_bytes (model/int4.h)
  int64_t n_total_experts = 0;    // experts of all MoE layers: more islands are useless
  int64_t min_islands = 1;        // top_k: one layer's experts of one token must fit at once
  size_t alignment = 256;         // every region and island starts on this boundary
};

// One region of the arena: [offset, offset + bytes) from the arena's base.
struct ArenaRegion {
  size_t offset = 0;
  size_t bytes = 0;
  size_t end() const { return offset + bytes; }
};

struct IslandPlan {
  size_t arena_bytes = 0;  // what to cudaMalloc: <= budget_bytes
  ArenaRegion nonexpert;
  ArenaRegion kv;
  ArenaRegion workspace;
  ArenaRegion islands;  // n_islands * island_stride bytes
  int64_t kv_blocks = 0;
  size_t kv_block_stride = 0;  // kv_bytes_per_block rounded up to the alignment
  int64_t n_islands = 0;
  size_t island_stride = 0;  // expert_blob_bytes rounded up to the alignment
  size_t expert_blob_bytes = 0;

  // Offset of island `i` (0 <= i < n_islands) from the arena's base.
  size_t island_offset(int64_t i) const { return islands.offset + size_t(i) * island_stride; }
  // Offset of KV block `b` (0 <= b < kv_blocks) from the arena's base.
  size_t kv_block_offset(int64_t b) const { return kv.offset + size_t(b) * kv_block_stride; }
  // One line for the start-up log: sizes of every region, islands and blocks.
  std::string describe() const;
};

// Fits the regions into the budget. Order of claims: non-expert weights,
// workspace, kv_blocks_min, min_islands (all mandatory); then KV up to
// kv_blocks_wanted; then islands up to n_total_experts. When the mandatory
// part does not fit, the error says what each part needs and what would fit.
[[nodiscard]] Result<IslandPlan> plan_islands(const IslandPlanRequest& req);

// "6.00 GiB", "2.40 MB"-style text for messages (binary units above 1 KiB).
std::string format_bytes(size_t bytes);

}  // namespace moe
