#pragma once
// The model on one GPU (docs/cuda-worker.md): bf16 non-expert weights, a
// paged bf16 KV pool, INT4 experts in islands of one device arena sized by
// the VRAM budget, the forward pass over the kernels of kernels/cuda, and
// sampling on the device. The same step contract as moe::CpuEngine
// (engine/engine.h), whose SeqInput / SeqOutput it takes.
//
// Thread ownership: one thread drives an engine (step, release, warm...).
// Built only with the CUDA toolkit; this header needs no CUDA headers.

#include <cstddef>
#include <atomic>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "engine/engine.h"
#include "gpu_worker/host_share.h"
#include "gpu_worker/island_plan.h"
#include "gpu_worker/residency.h"
#include "model/model_files.h"
#include "model/result.h"

namespace moe {

struct CudaEngineOptions {
  size_t vram_budget = 0;     // the whole process on the device; 0: free device memory less a margin
  // The arena alone instead (several engines in one process, as tests run
  // them side by side, cannot each own the whole process): when set,
  // vram_budget is ignored.
  size_t arena_budget = 0;
  // The router's rows in bf16 whatever the dense dtype (else INT8 at least).
  bool router_bf16 = false;
  int kv_blocks = 0;          // exactly this many; 0: what the experts leave (at least kv_blocks_min, up to 8 GiB)
  int kv_blocks_min = 64;     // with kv_blocks 0: the worker refuses to start with fewer
  int max_step_tokens = 512;  // tokens per forward pass (larger steps run as several)
  int max_context = 0;        // 0: the model's max_position (capped at 32768)
  std::string policy = "ours";  // eviction: lru | lfu | ours
  bool prefetch = true;         // budget mode: hint the next layer's predicted experts
  bool graphs = true;           // resident mode: replay decode steps as CUDA graphs
  int fuse_max_tokens = 4;      // up to this many tokens RMSNorm / SiLU are folded into the GEMVs (0..8)
  int q4_group = 64;            // quantising a checkpoint whose experts are not INT4 yet
  // Non-expert matrices: bf16, int8 (one scale per row), int4 (groups of 64
  // inputs, docs/int4-experts.md; the router's rows and lm_head stay int8,
  // a matrix narrower than 32-input runs too), or auto: bf16 when every
  // expert stays resident, else int8 (int4 only when int8 leaves no room;
  // its cost in quality in docs/cuda-worker.md). The embedding stays bf16.
  std::string dense_weights = "auto";
  // Under a budget (not every expert fits), keep the embedding in mapped
  // pinned host memory: a step reads one row per token over the link, and
  // its bytes become islands. Not done when a bf16 lm_head shares it.
  bool host_embedding = true;
  // Under a budget, the host's cores compute part of the misses from the
  // pinned blobs while the link brings the rest. Streamed batch-1 passes:
  // the first rows of every miss, by a table fixed at start from the two
  // measured rates (gpu_worker/host_share.h); copy mode: whole misses, per
  // layer on the host's running clock. host_threads 0: every hardware
  // thread but two (stream) or all (copy). "on", "off", or "auto": on where
  // the rates measured at start give the host any rows (in copy mode, where
  // the host has at least two threads). Which rows the host computes (f32,
  // the GPU half2) follows this machine's timings, and so may the last bits
  // of the logits; "off" keeps a budget run bit-identical to a resident one.
  std::string host_experts = "auto";
  // Under a budget, how decode passes (up to 8 tokens, not a prompt) meet a
  // miss: "stream", the expert kernels read it from pinned host memory over
  // the link (no host round trip inside the pass, so the pass is a CUDA
  // graph; experts the policy finds worth it are copied in after the pass,
  // at most stream_admit_per_pass a pass); or "copy", the host waits for
  // each layer's routes and copies the misses into islands first (with
  // prefetch of predicted experts, and the host split above).
  std::string misses = "stream";
  int stream_admit_per_pass = 8;
  int host_threads = 0;
  double host_link_us = 0;    // one expert over the link, µs; 0: measured at start (tests force a split with it)
  double host_expert_us = 0;  // one expert on the host's cores (streamed passes), µs; 0: measured at start
  // Benchmarks: 0, the router picks the experts; else every token's experts
  // are drawn uniformly (distinct, the router's weights kept) from this seed,
  // the layer, the position and the sequence: the uniform routing that the
  // offload targets are stated for, which random router weights do not give.
  uint64_t uniform_routing_seed = 0;
};

// What the experts cost and where they are (the worker's stats reply).
struct CudaExpertStats {
  ResidencyStats residency;
  int64_t islands_total = 0;
  bool all_resident = false;
  std::string dense_weights = "bf16";  // the non-expert matrices' dtype: bf16, int8 or int4
  bool host_embedding = false;  // the embedding in host memory (under a budget)
  uint64_t host_experts_served = 0;  // (layer, expert) misses computed on the host instead of copied
  uint64_t host_expert_tokens = 0;   // their (token, expert) pairs
  uint64_t bytes_streamed = 0;       // expert bytes kernels read from host memory (streamed misses)
  uint64_t host_share_served = 0;    // (token, expert) misses of streamed passes the host's cores took rows of
  ShareTimes share_times;            // those passes' shared layers: the host's time, the GPU's waits
};

// What the process holds on the device, the budget included (bytes).
struct DeviceMemory {
  uint64_t budget = 0;  // --vram-budget, or the default: the whole process's
  uint64_t base = 0;    // the context and libraries, before the arena
  uint64_t arena = 0;   // the one allocation the engine makes
  uint64_t now = 0;     // the process now, as NVML lists it (0 without NVML)
  uint64_t peak = 0;    // the largest `now` seen since the start
  bool measured = false;  // `now` and `peak` are NVML's
};

class CudaEngine {
 public:
  // Loads `files` onto the current CUDA device. Refuses architectures the
  // kernels do not cover (MLA) and budgets that cannot hold the model's
  // fixed part, saying what would fit.
  static Result<std::unique_ptr<CudaEngine>> create(std::shared_ptr<ModelFiles> files,
                                                    const CudaEngineOptions& opts);
  ~CudaEngine();
  CudaEngine(const CudaEngine&) = delete;
  CudaEngine& operator=(const CudaEngine&) = delete;

  // As CpuEngine::step: each input's tokens are appended at start_pos (0
  // starts afresh), a token is sampled after the last where `sample` is set;
  // fails without changing any state when an input is inconsistent or the
  // KV pool is short.
  Result<std::vector<SeqOutput>> step(std::span<const SeqInput> inputs);
  void release(uint64_t seq_id);
  // What the process holds on the device now (reads NVML: not every step).
  DeviceMemory device_memory() const;

  // A counter bumped as a step advances (each layer issued, each pass
  // finished): the worker's sign of life during long steps. nullptr: none.
  void set_progress(std::atomic<uint64_t>* progress);

  int kv_blocks_total() const;
  int kv_blocks_free() const;
  int kv_block_tokens() const;
  int max_context() const;
  int seq_length(uint64_t seq_id) const;  // -1 when unknown
  const ModelDesc& desc() const;
  const IslandPlan& plan() const;

  // ---- Experts
  // Makes experts resident into free islands only (re-warm, load_expert);
  // with may_evict (a gateway's warm hints) they may displace residents
  // that are neither in use nor predicted. Returns how many of `experts`
  // are resident (or on their way) afterwards.
  size_t warm(std::span<const ExpertKey> experts, bool may_evict = false);
  // Drops unpinned residents; returns the ones that could not be dropped.
  std::vector<ExpertKey> unload(std::span<const ExpertKey> experts);
  std::vector<ExpertKey> resident() const;  // ordered by (layer, expert)
  uint64_t residency_version() const;
  CudaExpertStats expert_stats() const;
  // After a failed step: the device's sticky error ("" when the device is
  // still usable and the failure was the step's own, e.g. a bad input).
  std::string device_error() const;

  struct Impl;

 private:
  CudaEngine() = default;
  std::unique_ptr<Impl> impl_;
};

// One line about the device the engine would run on ("NVIDIA H200, 139.8 GiB
// free of 139.8 GiB"), or an error when there is no usable device.
Result<std::string> cuda_device_summary();

}  // namespace moe
