#pragma once
// Where a streamed decode pass hands missed experts to the host's cores and
// takes their sum back (docs/cuda-worker.md, "The host's share"): one slot
// per MoE layer in mapped pinned host memory. The host computes the first
// `rows` intermediate rows of each missed (token, expert) pair (gate, up,
// and down over those inputs), the GPU the rest, streamed. The GPU writes
// the pairs and then `posted`; the host writes the sums and then `done`;
// each side spins on the other's flag. Plain data, read by both compilers; no CUDA header.

#include <cstdint>

namespace moe {

constexpr int kShareMaxTopK = 16;   // a token's top-k at most
constexpr int kShareMaxTokens = 8;  // tokens a shared pass has at most (streamed decode passes)
constexpr int kShareMaxPairs = kShareMaxTopK * kShareMaxTokens;

struct alignas(128) ShareSlot {
  uint32_t posted;  // GPU: the pass whose pairs below (and normed states) are valid
  uint32_t count;   // (token, expert) pairs the host computes this pass (0: none)
  uint32_t rows;    // of each: intermediate rows [0, rows) (the GPU does the rest)
  uint32_t tokens;  // the pass's tokens: the states and sums are [tokens, hidden]
  int32_t expert[kShareMaxPairs];
  uint8_t token[kShareMaxPairs];
  float weight[kShareMaxPairs];
  alignas(64) uint32_t done;  // host: the pass whose sum is written
  // GPU, after it saw `done`: how long the collecting kernel waited for it
  // (ns; the host reads it once the pass is over).
  alignas(64) uint64_t waited_ns;
};

}  // namespace moe
