#pragma once
// Routed experts computed on the host, for the CUDA engine under a budget:
// a layer's missed experts are split between the link (copied into islands,
// run on the GPU) and the host's cores (run here from the pinned host blob,
// the sum added to the residual on the GPU), so both move expert bytes at
// once (docs/cuda-worker.md, "A miss on the host or over the link").
//
// `plan_split` decides which misses go where from two measured rates; `run`
// computes sum_k w_k * down_e(silu(gate_e x_t) * up_e x_t) for the given
// (token, expert, weight) pairs with the CPU engine's INT4 matvec, rows
// spread over a thread pool. No CUDA here: the CPU tests cover it.
//
// Threads: one caller at a time (the engine's step thread).

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "kernels/cpu/thread_pool.h"
#include "model/int4.h"

namespace moe {

struct HostPair {
  int token = 0;                  // row of x and of the output
  const uint8_t* blob = nullptr;  // the expert's INT4 blob in host memory
  float weight = 0.f;             // its route weight for the token
};

// One missed expert of a layer and the tokens routed to it.
struct MissCost {
  int expert = 0;
  int tokens = 0;
};

// Which misses the host takes so that both sides finish about together:
// misses are taken fewest-tokens first; each goes to the side that would
// finish it sooner, the link paying link_us per expert (the copy serves all
// its tokens), the host host_us_per_token per routed token plus host_fixed_us
// once (moving the state down and the sum back up). Returns the experts for
// the host.
std::vector<int> plan_split(std::span<const MissCost> misses, double link_us, double host_us_per_token,
                            double host_fixed_us);

class HostExperts {
 public:
  // threads: the pool's size including the caller (0: every hardware thread).
  // int8_inputs: x and the SiLU product are quantised per group to int8 and
  // the matvecs run on integer dot products (q4_matvec_rows_q8), else the
  // CPU engine's f32 matvec.
  // On the H200 machine's 16 cores int8 inputs were no faster (both ~3 GB/s
  // a core, bench/results/cpu-host-experts-2026-11-29.txt) and are less
  // exact, so the engine uses f32.
  HostExperts(const ExpertLayout& layout, int threads, bool int8_inputs = false);

  const ExpertLayout& layout() const { return layout_; }
  int threads() const { return pool_.size(); }

  // y[n_tokens, hidden] = sum over pairs of weight * expert(x[token]);
  // x: [n_tokens, hidden] as bf16 bits (the engine's normed state). Rows of
  // y no pair names are zero.
  void run(const uint16_t* x_bf16, int n_tokens, std::span<const HostPair> pairs, float* y);

  // Microseconds one single-token expert takes here: the median of `reps`
  // runs after warm-up, going round `blobs` (distinct experts, so that a
  // run reads memory, as a miss does, not the cache the last run filled).
  // The host side of plan_split.
  double measure_us(std::span<const uint8_t* const> blobs, int reps = 9);

 private:
  ExpertLayout layout_;
  bool int8_;
  cpu::ThreadPool pool_;
  std::vector<Q8Input> xq_;  // [tokens]
  std::vector<Q8Input> hq_;  // [pairs]
  std::vector<float> x_;   // [tokens, hidden] f32
  std::vector<float> h_;   // [pairs, inter]: silu(gate x) * up x
  std::vector<float> g_;   // [pairs, inter]: up rows land here before the product
};

}  // namespace moe
