// The CUDA backend: protocol steps onto moe::CudaEngine (docs/cuda-worker.md).
#include <algorithm>
#include <chrono>
#include <filesystem>
#include <span>

#include "worker/engine_backend.h"
#include "cuda_engine/cuda_engine.h"
#include "model/model_config.h"
#include "worker/model_hello.h"
#include "worker/step_translation.h"

namespace moe::worker {
namespace {

class CudaBackend final : public EngineBackend {
 public:
  CudaBackend(std::unique_ptr<CudaEngine> engine, std::string model_id)
      : EngineBackend(*engine, std::move(model_id), "cuda"), engine_(std::move(engine)) {}

  protocol::StepReply step(const protocol::StepRequest& req) override {
    const CudaExpertStats before = engine_->expert_stats();
    protocol::StepReply reply = run_engine_step(*engine_, req, [this](const Result<std::vector<SeqOutput>>& out) {
      if (out.ok()) tally_expert_use(*out);
      if (!out.ok() && broken_.empty()) broken_ = engine_->device_error();
    });
    const CudaExpertStats after = engine_->expert_stats();
    if (after.all_resident) {
      // Every routed expert was resident: each use is a hit.
      uint64_t uses = 0;
      for (const auto& r : reply.results)
        for (uint16_t c : r.expert_usage) uses += c ? 1 : 0;
      reply.expert_hits = uint32_t(uses);
    } else {
      reply.expert_hits = uint32_t(after.residency.hits - before.residency.hits);
      reply.expert_misses = uint32_t(after.residency.misses - before.residency.misses);
    }
    return reply;
  }

  std::string device_memory_summary() const override {
    const DeviceMemory d = engine_->device_memory();
    auto mib = [](uint64_t b) { return std::to_string((b + (1 << 19)) >> 20) + " MiB"; };
    return "device memory: budget " + mib(d.budget) + ", context and libraries " + mib(d.base) + ", arena " +
           mib(d.arena) + (d.measured ? ", now " + mib(d.now) + ", peak " + mib(d.peak) : ", not measured (no NVML)");
  }

  std::string card_pci_bus_id() const override { return engine_->pci_bus_id(); }

  size_t warm(const std::vector<protocol::ExpertRef>& experts) override { return warm_in_pieces(experts, false); }
  void hint(const std::vector<protocol::ExpertRef>& experts) override { warm_in_pieces(experts, true); }
  void wait_for_copies() override {
    if (Status s = engine_->wait_for_copies(); !s)
      std::fprintf(stderr, "moe-worker: waiting for warmed experts' copies: %s\n", s.error().c_str());
  }
  void seed_residency(int moe_layer, std::span<const double> rates) override {
    engine_->seed_residency(moe_layer, rates);
  }
  std::vector<protocol::ExpertRef> resident() const override {
    std::vector<protocol::ExpertRef> out;
    for (const ExpertKey& k : engine_->resident())
      out.push_back({uint16_t(model_layer_of_moe_index(engine_->desc(), k.layer)), uint16_t(k.expert)});
    return out;
  }
  uint64_t residency_version() const override { return engine_->residency_version(); }

  protocol::LoadExpertReply load_experts(const protocol::LoadExpert& req) override {
    const auto t0 = std::chrono::steady_clock::now();
    const uint64_t bytes0 = engine_->expert_stats().residency.bytes_copied;
    protocol::LoadExpertReply r;
    r.layer = req.layer;
    const int ml = moe_index_of_layer(engine_->desc(), req.layer);
    for (uint16_t e : req.experts) {
      const ExpertKey k{ml, e};
      note_progress();
      if (engine_->warm(std::span<const ExpertKey>(&k, 1)) == 1)
        r.resident.push_back(e);
      else
        r.failed.push_back(e);
    }
    if (!r.failed.empty()) r.message = "no free island (or no such expert) for some experts; eviction makes room as steps need it";
    r.bytes_copied = engine_->expert_stats().residency.bytes_copied - bytes0;
    r.elapsed_us = uint32_t(
        std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::steady_clock::now() - t0).count());
    return r;
  }
  protocol::UnloadExpertReply unload_experts(const protocol::UnloadExpert& req) override {
    protocol::UnloadExpertReply r;
    r.layer = req.layer;
    std::vector<ExpertKey> keys;
    const int ml = moe_index_of_layer(engine_->desc(), req.layer);
    for (uint16_t e : req.experts) keys.push_back({ml, e});
    const std::vector<ExpertKey> failed = engine_->unload(keys);
    for (const ExpertKey& k : keys) {
      const bool f = std::any_of(failed.begin(), failed.end(), [&](const ExpertKey& x) { return x == k; });
      (f ? r.failed : r.unloaded).push_back(uint16_t(k.expert));
    }
    if (!r.failed.empty())
      r.message = engine_->expert_stats().all_resident ? "every expert fits the budget: none is unloaded"
                                                       : "expert in use or out of range";
    return r;
  }
  std::string broken() const override { return broken_; }
  void fill_expert_stats(protocol::StatsReply& r) const override {
    const CudaExpertStats s = engine_->expert_stats();
    r.expert_hits = s.residency.hits;
    r.expert_misses = s.residency.misses;
    r.bytes_copied = s.residency.bytes_copied;
    r.bytes_streamed = s.bytes_streamed;
    r.islands_used = uint32_t(s.residency.islands_in_use);
    r.islands_total = uint32_t(s.islands_total);
  }

 private:
  // Wire references name model layers; the engine's map counts MoE layers
  // (a layer without experts maps to -1, which the engine skips).
  std::vector<ExpertKey> keys_of(const std::vector<protocol::ExpertRef>& experts) const {
    std::vector<ExpertKey> keys;
    for (const auto& e : experts) keys.push_back({moe_index_of_layer(engine_->desc(), e.layer), e.expert});
    return keys;
  }

  // Copies in pieces of 16 experts, each a sign of progress: warming
  // thousands of experts is not a stuck worker.
  size_t warm_in_pieces(const std::vector<protocol::ExpertRef>& experts, bool may_evict) {
    const std::vector<ExpertKey> keys = keys_of(experts);
    size_t resident = 0;
    for (size_t i = 0; i < keys.size(); i += 16) {
      note_progress();
      resident += engine_->warm(std::span<const ExpertKey>(keys.data() + i, std::min<size_t>(16, keys.size() - i)),
                                may_evict);
    }
    return resident;
  }

  std::unique_ptr<CudaEngine> engine_;
  std::string broken_;  // a sticky device error seen after a failed step
};

}  // namespace

bool cuda_backend_built() { return true; }

std::string cuda_unavailable_reason(int device_index, std::string* device) {
  auto dev = cuda_device_summary(device_index);
  if (!dev.ok()) return dev.error();
  if (device) *device = dev.value();
  return "";
}

int cuda_devices() { return cuda_device_count(); }

std::string cuda_model_refusal(const std::string& model_path, const CudaEngineOptions& opts) {
  // A folder's config.json alone (opening a GPTQ/AWQ folder converts it);
  // a packed or GGUF file opens by mmap, cheaply.
  std::error_code ec;
  if (std::filesystem::is_directory(model_path, ec)) {
    auto d = load_model_desc(model_path);
    return d.ok() ? CudaEngine::model_refusal(d.value(), opts) : "";
  }
  auto files = ModelFiles::open(model_path);
  return files.ok() ? CudaEngine::model_refusal(files.value()->desc(), opts) : "";
}

Result<std::unique_ptr<Backend>> make_cuda_backend(const std::string& model_path, const CudaEngineOptions& opts) {
  auto files = ModelFiles::open(model_path);
  if (!files.ok()) return make_error(files.error());
  auto engine = CudaEngine::create(files.value(), opts);
  if (!engine.ok()) return make_error(engine.error());
  const std::string id = model_id_from_path(model_path);
  return std::unique_ptr<Backend>(new CudaBackend(std::move(engine.value()), id));
}

}  // namespace moe::worker
