// plan_islands: the arena carve-up arithmetic and its refusals.
#include "residency/island_plan.h"

#include <catch2/catch.hpp>

using namespace moe;

namespace {
constexpr size_t MiB = size_t(1) << 20;
constexpr size_t GiB = size_t(1) << 30;

// A 30B-class shape: 48 layers x 128 experts, 2.4 MiB-ish blobs (not aligned).
IslandPlanRequest big_model(size_t budget) {
  IslandPlanRequest r;
  r.budget_bytes = budget;
  r.nonexpert_bytes = 1536 * MiB + 3;
  r.kv_bytes_per_block = 48 * 2 * 16 * 512 * 2 + 100;  // deliberately not a multiple of 256
  r.kv_blocks_wanted = 2048;
  r.kv_blocks_min = 256;
  r.workspace_bytes = 256 * MiB;
  r.expert_blob_bytes = 2516736 + 17;
  r.n_total_experts = 48 * 128;
  r.min_islands = 8;
  return r;
}
}  // namespace

TEST_CASE("plan_islands: regions are aligned, disjoint, in order and within the budget") {
  const auto req = big_model(12 * GiB);
  auto p = plan_islands(req);
  REQUIRE(p.ok());
  CHECK(p->arena_bytes <= req.budget_bytes);
  for (const ArenaRegion* r : {&p->nonexpert, &p->workspace, &p->kv, &p->islands})
    CHECK(r->offset % 256 == 0);
  CHECK(p->nonexpert.offset == 0);
  CHECK(p->nonexpert.bytes >= req.nonexpert_bytes);
  CHECK(p->workspace.offset == p->nonexpert.end());
  CHECK(p->islands.offset == p->workspace.end());
  CHECK(p->kv.offset == p->islands.end());
  CHECK(p->arena_bytes == p->kv.end());
  CHECK(p->island_stride % 256 == 0);
  CHECK(p->island_stride >= req.expert_blob_bytes);
  CHECK(p->island_stride - req.expert_blob_bytes < 256);
  CHECK(p->kv_block_stride % 256 == 0);
  CHECK(p->island_offset(1) - p->island_offset(0) == p->island_stride);
  CHECK(p->island_offset(p->n_islands - 1) + p->island_stride == p->kv.offset);
  // KV blocks run down from the top: the start's fill the kv region exactly.
  CHECK(p->kv_block_offset(0) + p->kv_block_stride == p->arena_bytes);
  CHECK(p->kv_block_offset(p->kv_blocks - 1) == p->kv.offset);
}

TEST_CASE("plan_islands: KV growing down takes the islands nearest the top, never below the minimum") {
  const auto req = big_model(12 * GiB);
  auto p = plan_islands(req);
  REQUIRE(p.ok());
  CHECK(p->islands_with_kv(p->kv_blocks) == p->n_islands);
  CHECK(p->islands_with_kv(0) == p->n_islands);  // never more than the start's
  // One block more crosses into the top island.
  CHECK(p->islands_with_kv(p->kv_blocks + 1) == p->n_islands - 1);
  const int64_t per_island = int64_t(p->island_stride / p->kv_block_stride);  // whole blocks an island holds
  REQUIRE(per_island >= 1);
  for (int64_t extra : {int64_t(1), per_island, per_island + 1, 10 * per_island + 3}) {
    const int64_t blocks = p->kv_blocks + extra;
    const int64_t isl = p->islands_with_kv(blocks);
    // Every usable island lies wholly below the lowest block.
    CHECK(p->island_offset(isl - 1) + p->island_stride <= p->kv_block_offset(blocks - 1));
    // and one more would not.
    CHECK(p->island_offset(isl) + p->island_stride > p->kv_block_offset(blocks - 1));
  }
  const int64_t most = p->kv_blocks_reachable(req.min_islands);
  CHECK(p->islands_with_kv(most) >= req.min_islands);
  CHECK(p->islands_with_kv(most + 1) < req.min_islands);
  CHECK(p->kv_blocks_reachable(p->n_islands) == p->kv_blocks);  // no island to spare: the start's KV
}

TEST_CASE(
    "plan_islands: KV gets what was wanted, islands take the rest, no more than the model's "
    "experts") {
  auto req = big_model(12 * GiB);
  auto p = plan_islands(req);
  REQUIRE(p.ok());
  CHECK(p->kv_blocks == 2048);
  // Exactly as many islands as fit in what is left: one more would not.
  const size_t left = req.budget_bytes - p->islands.offset - p->kv.bytes;
  CHECK(p->n_islands == int64_t(left / p->island_stride));
  CHECK(p->n_islands < req.n_total_experts);

  req.budget_bytes = 64 * GiB;  // everything fits: islands stop at all experts
  auto all = plan_islands(req);
  REQUIRE(all.ok());
  CHECK(all->n_islands == req.n_total_experts);
  CHECK(all->kv_blocks == 2048);
  CHECK(all->arena_bytes < req.budget_bytes);
}

TEST_CASE("plan_islands: a tight budget trims KV toward its minimum before refusing") {
  auto req = big_model(0);
  const size_t stride_isl = (req.expert_blob_bytes + 255) / 256 * 256;
  const size_t stride_kv = (req.kv_bytes_per_block + 255) / 256 * 256;
  const size_t fixed = (req.nonexpert_bytes + 255) / 256 * 256 + req.workspace_bytes;
  // Mandatory part plus 10 extra KV blocks and half an island.
  req.budget_bytes = fixed + 256 * stride_kv + 8 * stride_isl + 10 * stride_kv + stride_isl / 2;
  auto p = plan_islands(req);
  REQUIRE(p.ok());
  CHECK(p->kv_blocks == 266);
  CHECK(p->n_islands == 8);
  CHECK(p->arena_bytes <= req.budget_bytes);

  req.budget_bytes -= 11 * stride_kv;  // one byte-range short of the minimum KV + top_k islands
  auto q = plan_islands(req);
  REQUIRE_FALSE(q.ok());
}

TEST_CASE("plan_islands: the refusal says what each part needs and what would fit") {
  auto req = big_model(2 * GiB);
  auto p = plan_islands(req);
  REQUIRE_FALSE(p.ok());
  const std::string& m = p.error();
  INFO(m);
  CHECK(m.find("budget 2.00 GiB") != std::string::npos);
  CHECK(m.find("non-expert weights need 1.50 GiB") != std::string::npos);
  CHECK(m.find("KV minimum") != std::string::npos);
  CHECK(m.find("256 blocks") != std::string::npos);
  CHECK(m.find("at least 8 needed") != std::string::npos);
  CHECK(m.find("would fit") != std::string::npos);
  // 2 GiB - 1.5 GiB - 256 MiB workspace - 256 blocks of 1.5 MiB = -128 MiB: over before any expert.
  CHECK(m.find("over budget before any expert") != std::string::npos);

  req.budget_bytes = 2 * GiB + 128 * MiB + 5 * MiB;  // room for 2 experts, 8 needed
  auto q = plan_islands(req);
  REQUIRE_FALSE(q.ok());
  INFO(q.error());
  CHECK(q.error().find("leaves room for 2 experts of 2.40 MiB") != std::string::npos);
}

TEST_CASE("plan_islands: rejects nonsense inputs") {
  auto req = big_model(12 * GiB);
  req.expert_blob_bytes = 0;
  CHECK_FALSE(plan_islands(req).ok());
  req = big_model(12 * GiB);
  req.alignment = 300;
  CHECK_FALSE(plan_islands(req).ok());
  req = big_model(12 * GiB);
  req.min_islands = req.n_total_experts + 1;
  CHECK_FALSE(plan_islands(req).ok());
}

TEST_CASE("format_bytes: binary units") {
  CHECK(format_bytes(512) == "512 B");
  CHECK(format_bytes(1536) == "1.5 KiB");
  CHECK(format_bytes(6 * GiB) == "6.00 GiB");
  CHECK(format_bytes(2516736) == "2.40 MiB");
}
