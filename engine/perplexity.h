#pragma once
// Mean negative log-likelihood of a token stream, the way the reference
// figures are computed: the ids are cut into windows of ctx + 1 tokens that
// overlap by one (window i holds ids i*ctx ... (i+1)*ctx; the last may be
// shorter), and every token of a window after its first is predicted from
// the ones before it within that window.

#include <cstdint>
#include <functional>
#include <span>

#include "engine/cpu_engine.h"

namespace moe {

struct NllResult {
  double nll = 0;      // mean negative log-likelihood per predicted token (nats)
  int64_t tokens = 0;  // predicted tokens
};

// progress(done_tokens, total_tokens) after each window (may be empty).
[[nodiscard]] Result<NllResult> mean_nll(
    CpuEngine& engine, std::span<const int32_t> ids, int ctx,
    const std::function<void(int64_t, int64_t)>& progress = {});

}  // namespace moe
