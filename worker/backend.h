#pragma once
// What runs a worker's steps: the model, its KV cache and sampling behind one
// interface, so that the socket server does not care whether the CPU engine
// or the CUDA engine computes. One thread drives a backend at a time.

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "cuda_engine/engine_options.h"
#include "engine/cpu_engine.h"
#include "model/result.h"
#include "protocol/messages.h"

namespace moe::worker {

class Backend {
 public:
  virtual ~Backend() = default;
  // The capacity fields of the worker's hello (model id, backend name, KV
  // blocks, max context, vocab, EOS ids, expert layout).
  virtual protocol::Hello describe() const = 0;
  // Runs one step; one result per request sequence, in order. A sequence the
  // backend cannot run (bad start_pos, token out of range, no KV) gets its
  // own error; the others run.
  virtual protocol::StepReply step(const protocol::StepRequest& req) = 0;
  // Frees the sequences' KV (unknown ids are ignored).
  virtual void release(uint64_t seq_id) = 0;
  // KV blocks the backend can reach (its pool may grow into expert islands,
  // docs/kv-islands-trade.md), and of those the ones no sequence holds.
  virtual int kv_blocks_total() const = 0;
  virtual int kv_blocks_free() const = 0;
  // About once a second while no step runs (KV idle long enough goes back
  // to the islands).
  virtual void idle() {}
  virtual int sequences_active() const = 0;

  // ---- Expert residency (re-warm after a restart, warm hints, state for Redis)
  // Makes `experts` resident, in order, while free islands last (never
  // evicting); returns how many became or already were resident.
  virtual size_t warm(const std::vector<protocol::ExpertRef>& /*experts*/) { return 0; }
  // A gateway's warm hints for a coming prompt: like warm, but the hinted
  // experts may displace cold residents (not those in use, nor other
  // predictions), so that their copies start before the prompt's step.
  virtual void hint(const std::vector<protocol::ExpertRef>& experts) { warm(experts); }
  // Returns once the copies warm() queued have landed (a re-warm's time is
  // then the copies', not their queueing).
  virtual void wait_for_copies() {}
  // The eviction policy's prior for one MoE layer (index among MoE layers):
  // each expert's share of tokens in a routing profile. Before warm().
  virtual void seed_residency(int /*moe_layer*/, std::span<const double> /*rates*/) {}
  // The resident experts now, ordered by (layer, expert).
  virtual std::vector<protocol::ExpertRef> resident() const { return {}; }
  // Changes whenever the resident set changes (publish after a change).
  virtual uint64_t residency_version() const { return 0; }
  // Tokens each expert served since count_expert_use(true), [moe layer *
  // n_experts + expert] (empty: not counted), and the tokens counted: what
  // --save-profile writes (residency/routing_profile.h). Off by default: a
  // worker that saves no profile adds nothing to its steps.
  virtual void count_expert_use(bool /*on*/) {}
  virtual const std::vector<uint64_t>& expert_use() const {
    static const std::vector<uint64_t> none;
    return none;
  }
  virtual uint64_t expert_use_tokens() const { return 0; }

  // load_expert / unload_expert. The default: a backend that reads every
  // expert from host memory has them all resident and drops none.
  virtual protocol::LoadExpertReply load_experts(const protocol::LoadExpert& req) {
    protocol::LoadExpertReply r;
    r.layer = req.layer;
    r.resident = req.experts;
    return r;
  }
  virtual protocol::UnloadExpertReply unload_experts(const protocol::UnloadExpert& req) {
    protocol::UnloadExpertReply r;
    r.layer = req.layer;
    r.failed = req.experts;
    r.message = "this backend keeps every expert in host memory";
    return r;
  }
  // The expert counters of the stats reply (hits, misses, bytes, islands).
  virtual void fill_expert_stats(protocol::StatsReply& /*r*/) const {}
  // One line on the device memory the process holds ("" without a device).
  virtual std::string device_memory_summary() const { return {}; }
  // The PCI bus id of the card the backend computes on ("" without one):
  // the card whose health the worker samples (card/health_monitor.h).
  virtual std::string card_pci_bus_id() const { return {}; }
  // Non-empty once the backend can no longer compute (a sticky device
  // error): the worker then says `break` and exits for supervision to
  // restart it, leaving the step unanswered so that the gateway reruns it.
  virtual std::string broken() const { return {}; }
  // A counter the backend bumps as a step advances (a layer, an expert's
  // copy): the worker's sign of life to the gateway during long steps.
  // nullptr: none. Bumped from the step thread only; read by another.
  virtual void set_progress(std::atomic<uint64_t>* progress) { progress_ = progress; }

 protected:
  void note_progress() const {
    if (progress_) progress_->fetch_add(1, std::memory_order_relaxed);
  }
  std::atomic<uint64_t>* progress_ = nullptr;
};

// The CPU backend over moe::CpuEngine. `model_path`: folder or packed file.
Result<std::unique_ptr<Backend>> make_cpu_backend(const std::string& model_path, const EngineOptions& opts);


// True when this binary was built with the CUDA backend.
bool cuda_backend_built();
// Why the CUDA backend cannot run here ("" when it can): a build without the
// toolkit, or no visible device. `device` gets the device's name and memory.
std::string cuda_unavailable_reason(int device_index, std::string* device = nullptr);
// CUDA devices this process sees (0 in a build without the toolkit).
int cuda_devices();
// Why the CUDA backend would refuse the model at `model_path` ("" when it
// serves it, or when the description cannot be read: opening then says why).
std::string cuda_model_refusal(const std::string& model_path, const CudaEngineOptions& opts);
// The CUDA backend (cuda_engine/cuda_engine.h); an error without a device or
// in a binary built without CUDA.
Result<std::unique_ptr<Backend>> make_cuda_backend(const std::string& model_path, const CudaEngineOptions& opts);

}  // namespace moe::worker
