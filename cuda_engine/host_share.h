#pragma once
// Missed experts computed on the host's cores inside a streamed decode pass
// (docs/cuda-worker.md, "The host's share"). The GPU and the host meet in
// mapped pinned memory (kernels/cuda/share_slot.h), with no CUDA call inside
// the pass: after each MoE layer's router a kernel posts the missed experts
// the host takes and the layer's normed state; this class's leader thread,
// spinning on those posts, computes them with the CPU engine's INT4 matvec,
// in chunks of rows that a team of threads (spinning too while a pass runs)
// claims as it goes, and posts the weighted sum back, which a kernel adds to
// the residual.
//
// While the link streams the GPU's misses, the host's memory feeds its own:
// two paths for expert bytes at once. No CUDA here; the CPU tests play the
// GPU's part through the same memory.
//
// Threads: begin / end / measure_us from one thread (the engine's step
// thread); the class runs its own leader and workers.

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <span>
#include <thread>
#include <vector>

#include "kernels/cuda/share_slot.h"
#include "model/int4.h"

namespace moe {

// The memory both sides see, per MoE layer: the slot, the posted states
// ([tokens, hidden] bf16 bits) and the host's sums ([tokens, hidden] f32),
// room for kShareMaxTokens tokens each.
struct ShareMemory {
  ShareSlot* slots = nullptr;  // [layers]
  uint16_t* x = nullptr;       // [layers, kShareMaxTokens, hidden]
  float* sum = nullptr;        // [layers, kShareMaxTokens, hidden]
};

// rows[m] for m = 0..max_pairs: of each of a layer's m missed (token,
// expert) pairs, the host computes intermediate rows [0, rows[m]) (a
// multiple of `step` up to inter) and the link streams the rest, so that
// both finish soonest: the link at link_us a whole expert, the host at
// host_us a whole expert plus fixed_us (the hand-overs); ties go to the
// link. (A pair counts as an expert of its own on both sides: under the
// uniform routing the table is for, a pass's tokens rarely share a miss.)
std::vector<uint16_t> share_rows_table(int max_pairs, int inter, int step, double link_us, double host_us,
                                       double fixed_us);

// Where the time of the shared layers went, summed over passes.
struct ShareTimes {
  uint64_t layers = 0;     // layers the host computed a share of
  double host_us = 0;      // the host's time computing them (post seen to done)
  double gpu_wait_us = 0;  // the GPU's time waiting for them after its own part
  double max_wait_us = 0;  // the longest of those waits
  uint64_t stalls = 0;     // waits over kShareStallUs
};
constexpr double kShareStallUs = 50;

class HostShare {
 public:
  // blobs: [layers * n_experts] each expert's INT4 blob in host memory.
  // threads: leader and workers together (at least 1).
  HostShare(const ExpertLayout& layout, int layers, int n_experts, std::vector<const uint8_t*> blobs,
            ShareMemory mem, int threads);
  ~HostShare();
  HostShare(const HostShare&) = delete;
  HostShare& operator=(const HostShare&) = delete;

  int threads() const { return int(workers_.size()) + 1; }

  // Serves pass `pass` (never 0): for each layer in order, waits for its post,
  // computes the pairs it names (if any) and marks it done. end() returns
  // once the leader has finished the pass; with ok false (the pass failed,
  // posts may never come) it abandons it first.
  void begin(uint32_t pass);
  void end(bool ok);

  // Microseconds one expert takes here through the same path (the median
  // of `reps` after warm-up, going round distinct experts so each run reads
  // memory as a miss does).
  double measure_us(int reps = 9);

  // (token, expert) pairs computed here, over all passes.
  uint64_t experts_served() const { return served_; }
  ShareTimes times() const { return times_; }
  // The distinct experts the host computed rows of for `layer` in the last
  // pass (after end()), and the intermediate rows it computed of each.
  const std::vector<int32_t>& taken(int layer) const { return taken_[size_t(layer)]; }
  int taken_rows(int layer) const { return taken_rows_[size_t(layer)]; }

 private:
  void leader_loop();
  void worker_loop(int index);
  void serve(uint32_t pass);
  // Runs fn(thread_index, threads) on every thread (the leader included)
  // and returns when all have.
  template <typename Fn>
  void on_all(Fn&& fn);
  // count (expert, token, weight) pairs of `tokens` tokens: states x_bf16
  // and sums [tokens, hidden].
  void compute(int layer, const int32_t* experts, const uint8_t* token_of, const float* weights, int count, int rows,
               int tokens, const uint16_t* x_bf16, float* sum);

  ExpertLayout layout_;
  int layers_ = 0, n_experts_ = 0;
  std::vector<const uint8_t*> blobs_;
  ShareMemory mem_;

  // The pass: begin() hands it to the leader, end() waits for it.
  std::mutex mu_;
  std::condition_variable cv_;
  uint32_t want_ = 0;        // pass asked for (guarded by mu_)
  uint32_t finished_ = 0;    // last pass served (guarded by mu_)
  std::atomic<bool> abandon_{false};
  std::atomic<bool> quit_{false};
  std::thread leader_;

  // The team: workers spin on `epoch_` while `awake_`, else sleep on cv_.
  std::atomic<bool> awake_{false};
  std::atomic<uint64_t> epoch_{0};
  std::atomic<int> pending_{0};
  const void* job_ = nullptr;
  void (*job_call_)(const void*, int, int) = nullptr;
  std::vector<std::thread> workers_;

  // Scratch: the state in f32 (the CPU engine's matvec: int8 inputs were
  // no faster on the GPU machine's host and are less exact), per-pair SiLU
  // products, the inputs' group sums, per-thread row outputs.
  std::vector<float> xf_, h_, g_, sums_;
  std::vector<std::vector<float>> rows_;
  std::vector<std::vector<int32_t>> taken_;  // [layers]
  std::vector<int> taken_rows_;              // [layers]
  uint64_t served_ = 0;
  std::vector<double> layer_us_;  // [layers] the host's time on each in the pass being served
  ShareTimes times_;
  std::atomic<int> next_chunk_{0};  // the start of the next chunk of a phase a thread claims
};

}  // namespace moe
