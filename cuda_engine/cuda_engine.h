#pragma once
// The model on one GPU (docs/cuda-worker.md): bf16 non-expert weights, a
// paged bf16 KV pool, INT4 experts in islands of one device arena sized by
// the VRAM budget, the forward pass over the kernels of kernels/cuda, and
// sampling on the device. An Engine (engine/engine.h) on the step contract
// of engine/step.h, as moe::CpuEngine is.
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
#include "cuda_engine/engine_options.h"
#include "cuda_engine/host_share.h"
#include "residency/island_plan.h"
#include "residency/residency.h"
#include "model/model_files.h"
#include "model/result.h"

namespace moe {


// What the experts cost and where they are (the worker's stats reply).
struct CudaExpertStats {
  ResidencyStats residency;
  int64_t islands_total = 0;   // now: fewer than at start while the KV holds some (docs/kv-islands-trade.md)
  int64_t islands_start = 0;   // the start's plan
  uint64_t kv_grows = 0, kv_give_backs = 0;  // the KV cache taking islands, giving them back
  uint64_t kv_islands_taken = 0;             // residents evicted for it
  uint64_t router_guesses = 0;  // copy-mode layers whose prefetch took the next router's guess
  bool all_resident = false;
  std::string dense_weights = "bf16";  // the non-expert matrices' dtype: bf16, int8 or int4
  std::string kv_dtype = "bf16";       // the KV cache's rows: bf16, int8 or fp8
  bool host_embedding = false;  // the embedding in host memory (under a budget)
  uint64_t host_experts_served = 0;  // (layer, expert) misses computed on the host instead of copied
  uint64_t host_expert_tokens = 0;   // their (token, expert) pairs
  uint64_t bytes_streamed = 0;       // expert bytes kernels read from host memory (streamed misses)
  uint64_t host_share_served = 0;    // (token, expert) misses of streamed passes the host's cores took rows of
  ShareTimes share_times;            // those passes' shared layers: the host's time, the GPU's waits
  // The fused decode pass (CudaEngineOptions::fused_decode): "on", or why
  // it is off ("off" where the option is), and the passes it ran.
  std::string fused_decode = "off";
  uint64_t fused_passes = 0;
  // With bench_fused_stamps, the last fused pass: per phase (q|k|v,
  // attention, o, router, gate|up, down) the µs a layer block 0 worked, then
  // the µs it spent in the barrier after (waiting for the slowest block).
  std::vector<double> fused_phase_us;
  uint64_t experts_staged = 0;       // guessed experts copied a layer ahead (stream_ahead); each also
                                     // counts in bytes_streamed when a pass used it
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

class CudaEngine final : public Engine {
 public:
  // Loads `files` onto the current CUDA device. Refuses architectures the
  // kernels do not cover (model_refusal) and budgets that cannot hold the model's
  // fixed part, saying what would fit.
  static Result<std::unique_ptr<CudaEngine>> create(std::shared_ptr<ModelFiles> files,
                                                    const CudaEngineOptions& opts);
  // Why create() refuses a model of this description with these options ("" when it serves it).
  static std::string model_refusal(const ModelDesc& d, const CudaEngineOptions& opts);
  ~CudaEngine();
  CudaEngine(const CudaEngine&) = delete;
  CudaEngine& operator=(const CudaEngine&) = delete;

  // The contract of engine/engine.h; steps run on the device's stream and
  // return when their outputs are on the host.
  Result<std::vector<SeqOutput>> step(std::span<const SeqInput> inputs) override;
  void release(uint64_t seq_id) override;
  void set_progress(std::atomic<uint64_t>* progress) override;
  const ModelDesc& desc() const override;
  int max_context() const override;
  const KvBlockPool& kv_pool() const override;
  int kv_blocks_growable() const override;
  void idle() override;

  // What the process holds on the device now (reads NVML: not every step).
  DeviceMemory device_memory() const;
  // The device's PCI bus id ("0000:3b:00.0"): the card NVML reads for it.
  const std::string& pci_bus_id() const;

  const IslandPlan& plan() const;

  // ---- Experts
  // Makes experts resident into free islands only (re-warm, load_expert);
  // with may_evict (a gateway's warm hints) they may displace residents
  // that are neither in use nor predicted. Returns how many of `experts`
  // are resident (or on their way) afterwards.
  size_t warm(std::span<const ExpertKey> experts, bool may_evict = false);
  // Until every expert copy queued so far has landed (a timed re-warm).
  Status wait_for_copies();
  // The eviction policy's prior for a MoE layer: each expert's share of
  // tokens in a routing profile (EvictionPolicy::seed). Before warm(), so
  // that the first prompts evict the profile's cold experts first.
  void seed_residency(int moe_layer, std::span<const double> rates);
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
Result<std::string> cuda_device_summary(int index = 0);

// The CUDA devices this process sees (0: none), and whether device `index`
// is one of them (else how many there are); neither makes a context.
int cuda_device_count();
Status check_cuda_device(int index);

}  // namespace moe
