#pragma once
// The carve-up of the one device arena the worker allocates at start-up:
// non-expert weights, a workspace, equal-size expert islands growing up from
// the workspace, and the KV pool's fixed-size blocks growing down from the
// arena's top (docs/memory-islands.md, docs/kv-islands-trade.md). Pure
// arithmetic, no CUDA: the worker plans first and allocates once from the
// plan; at run time KV blocks may take the islands nearest the top and give
// them back.

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
  ArenaRegion kv;          // the start's blocks: the top kv_blocks * kv_block_stride bytes
  ArenaRegion workspace;
  ArenaRegion islands;     // the start's islands: n_islands * island_stride bytes, right below kv
  int64_t kv_blocks = 0;
  size_t kv_block_stride = 0;  // kv_bytes_per_block rounded up to the alignment
  int64_t n_islands = 0;
  size_t island_stride = 0;  // expert_blob_bytes rounded up to the alignment
  size_t expert_blob_bytes = 0;

  // Offset of island `i` (0 <= i < n_islands) from the arena's base.
  size_t island_offset(int64_t i) const { return islands.offset + size_t(i) * island_stride; }
  // Offset of KV block `b` from the arena's base: block 0 at the top, ids
  // running down, so that blocks added at run time (b >= kv_blocks) move
  // none before them.
  size_t kv_block_offset(int64_t b) const { return arena_bytes - size_t(b + 1) * kv_block_stride; }
  // Islands wholly below the KV when it holds `blocks` blocks (never more
  // than the start's n_islands).
  int64_t islands_with_kv(int64_t blocks) const;
  // The most KV blocks that leave `min_islands` islands (at least kv_blocks).
  int64_t kv_blocks_reachable(int64_t min_islands) const;
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
