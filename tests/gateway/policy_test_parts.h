#pragma once
// What the BatchPolicy tests without sockets share: a worker's answer to a
// step, every sampling chunk given token base + its sequence id.

#include <vector>

#include "gateway/sched/scheduler_policy.h"

namespace moe::gw::test {

inline std::vector<ChunkResult> answer(const StepPlan& p, int base = 100) {
  std::vector<ChunkResult> out;
  for (const auto& c : p.chunks) {
    ChunkResult r;
    r.seq_id = c.seq_id;
    r.sampled = c.sample;
    r.token.token = c.sample ? base + int(c.seq_id) : 0;
    out.push_back(r);
  }
  return out;
}

}  // namespace moe::gw::test
