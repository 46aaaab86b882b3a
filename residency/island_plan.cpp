#include "residency/island_plan.h"

#include <algorithm>
#include <cstdio>

namespace moe {

namespace {

size_t align_up(size_t v, size_t a) { return (v + a - 1) / a * a; }

bool is_power_of_two(size_t v) { return v && !(v & (v - 1)); }

}  // namespace

std::string format_bytes(size_t bytes) {
  char buf[48];
  const double b = double(bytes);
  if (bytes >= (size_t(1) << 30))
    std::snprintf(buf, sizeof buf, "%.2f GiB", b / double(size_t(1) << 30));
  else if (bytes >= (size_t(1) << 20))
    std::snprintf(buf, sizeof buf, "%.2f MiB", b / double(size_t(1) << 20));
  else if (bytes >= 1024)
    std::snprintf(buf, sizeof buf, "%.1f KiB", b / 1024.0);
  else
    std::snprintf(buf, sizeof buf, "%zu B", bytes);
  return buf;
}

Result<IslandPlan> plan_islands(const IslandPlanRequest& r) {
  if (!is_power_of_two(r.alignment))
    return make_error("island plan: alignment must be a power of two");
  if (r.expert_blob_bytes == 0) return make_error("island plan: expert blob size is 0");
  if (r.kv_bytes_per_block == 0) return make_error("island plan: KV block size is 0");
  if (r.kv_blocks_min < 0 || r.kv_blocks_wanted < 0 || r.min_islands < 0 || r.n_total_experts < 0)
    return make_error("island plan: negative counts");
  if (r.min_islands > r.n_total_experts)
    return make_error("island plan: at least " + std::to_string(r.min_islands) +
                      " islands needed but the model has only " +
                      std::to_string(r.n_total_experts) + " experts");

  const size_t a = r.alignment;
  IslandPlan p;
  p.expert_blob_bytes = r.expert_blob_bytes;
  p.island_stride = align_up(r.expert_blob_bytes, a);
  p.kv_block_stride = align_up(r.kv_bytes_per_block, a);

  // Fixed regions first; each starts aligned.
  p.nonexpert = {0, align_up(r.nonexpert_bytes, a)};
  p.workspace = {p.nonexpert.end(), align_up(r.workspace_bytes, a)};
  const size_t fixed = p.workspace.end();
  const size_t kv_min_bytes = size_t(r.kv_blocks_min) * p.kv_block_stride;
  const size_t islands_min_bytes = size_t(r.min_islands) * p.island_stride;

  if (fixed + kv_min_bytes + islands_min_bytes > r.budget_bytes) {
    // Say what each part needs and what the rest leaves for experts.
    std::string m = "budget " + format_bytes(r.budget_bytes) + ": non-expert weights need " +
                    format_bytes(r.nonexpert_bytes) + ", workspace " +
                    format_bytes(r.workspace_bytes) + ", KV minimum " + format_bytes(kv_min_bytes) +
                    " (" + std::to_string(r.kv_blocks_min) + " blocks of " +
                    format_bytes(r.kv_bytes_per_block) + ")";
    const size_t taken = fixed + kv_min_bytes;
    const int64_t room =
        taken >= r.budget_bytes ? 0 : int64_t((r.budget_bytes - taken) / p.island_stride);
    m += taken >= r.budget_bytes ? ", already " + format_bytes(taken - r.budget_bytes) +
                                       " over budget before any expert"
                                 : ", leaves room for " + std::to_string(room) + " experts of " +
                                       format_bytes(r.expert_blob_bytes);
    m += "; at least " + std::to_string(r.min_islands) +
         " needed (top_k of one layer); a budget of " +
         format_bytes(fixed + kv_min_bytes + islands_min_bytes) + " would fit";
    return make_error(m);
  }

  size_t left = r.budget_bytes - fixed - kv_min_bytes - islands_min_bytes;
  // KV up to what was asked for, then islands up to every expert resident.
  const int64_t extra_kv = std::max<int64_t>(0, r.kv_blocks_wanted - r.kv_blocks_min);
  const int64_t kv_more = std::min<int64_t>(extra_kv, int64_t(left / p.kv_block_stride));
  left -= size_t(kv_more) * p.kv_block_stride;
  const int64_t isl_more =
      std::min<int64_t>(r.n_total_experts - r.min_islands, int64_t(left / p.island_stride));

  p.kv_blocks = r.kv_blocks_min + kv_more;
  p.n_islands = r.min_islands + isl_more;
  p.islands = {fixed, size_t(p.n_islands) * p.island_stride};
  p.kv = {p.islands.end(), size_t(p.kv_blocks) * p.kv_block_stride};
  p.arena_bytes = p.kv.end();
  return p;
}

int64_t IslandPlan::islands_with_kv(int64_t blocks) const {
  const size_t kv_bytes = size_t(std::max<int64_t>(blocks, 0)) * kv_block_stride;
  if (island_stride == 0 || kv_bytes + islands.offset >= arena_bytes) return 0;
  return std::min<int64_t>(n_islands, int64_t((arena_bytes - kv_bytes - islands.offset) / island_stride));
}

int64_t IslandPlan::kv_blocks_reachable(int64_t min_islands) const {
  if (kv_block_stride == 0) return kv_blocks;
  const size_t keep = islands.offset + size_t(std::clamp<int64_t>(min_islands, 0, n_islands)) * island_stride;
  return std::max<int64_t>(kv_blocks, int64_t((arena_bytes - keep) / kv_block_stride));
}

std::string IslandPlan::describe() const {
  return "arena " + format_bytes(arena_bytes) + ": non-expert " + format_bytes(nonexpert.bytes) +
         ", workspace " + format_bytes(workspace.bytes) + ", KV " + std::to_string(kv_blocks) +
         " blocks (" + format_bytes(kv.bytes) + "), " + std::to_string(n_islands) + " islands of " +
         format_bytes(island_stride) + " (" + format_bytes(islands.bytes) + ")";
}

}  // namespace moe
