// The CPU backend: protocol steps onto moe::CpuEngine.
#include <algorithm>
#include <span>

#include "engine/cpu_engine.h"
#include "worker/engine_backend.h"
#include "worker/model_hello.h"
#include "residency/residency.h"
#include "worker/step_translation.h"

namespace moe::worker {
namespace {

class CpuBackend final : public EngineBackend {
 public:
  CpuBackend(std::unique_ptr<CpuEngine> engine, std::string model_id)
      : EngineBackend(*engine, std::move(model_id), "cpu"),
        residency_(engine->desc().n_moe_layers(), engine->desc().moe.n_experts,
                   cpu_islands(engine->desc().n_moe_layers(), engine->desc().moe.n_experts), 0,
                   std::make_unique<OursPolicy>()),
        engine_(std::move(engine)) {}

  // A quarter of all experts, as a small GPU's island budget would hold, under
  // the CUDA engine's default policy (ours).
  static int64_t cpu_islands(int moe_layers, int experts) {
    return std::max<int64_t>(1, int64_t(moe_layers) * experts / 4);
  }

  protocol::StepReply step(const protocol::StepRequest& req) override {
    return run_engine_step(*engine_, req, [this](const Result<std::vector<SeqOutput>>& out) {
      if (!out.ok()) return;
      tally_expert_use(*out);
      for (const SeqOutput& o : *out) touch_experts(o.expert_counts);
    });
  }

  // Residency on this backend: every expert is readable from the mapped
  // model, so the map is bookkeeping of the experts a GPU worker of the same
  // island budget would hold (what is reported, published and re-warmed).
  size_t warm(const std::vector<protocol::ExpertRef>& experts) override {
    size_t resident = 0;
    for (const protocol::ExpertRef& e : experts) {
      const int ml = moe_index_of_layer(engine_->desc(), e.layer);
      if (ml < 0 || e.expert >= residency_.n_experts()) continue;
      const int expert = e.expert;
      const auto placed = residency_.hint(ml, std::span<const int>(&expert, 1), HintPriority::warm);
      if (!placed.empty()) ++residency_version_;
      if (residency_.lookup({ml, e.expert}) >= 0) ++resident;
    }
    return resident;
  }
  void seed_residency(int moe_layer, std::span<const double> rates) override { residency_.seed(moe_layer, rates); }
  std::vector<protocol::ExpertRef> resident() const override {
    std::vector<protocol::ExpertRef> out;
    for (int64_t i = 0; i < residency_.n_islands(); ++i)
      if (auto k = residency_.resident(i))
        out.push_back({uint16_t(model_layer_of_moe_index(engine_->desc(), k->layer)), uint16_t(k->expert)});
    std::sort(out.begin(), out.end(),
              [](const auto& a, const auto& b) { return a.layer != b.layer ? a.layer < b.layer : a.expert < b.expert; });
    return out;
  }
  uint64_t residency_version() const override { return residency_version_; }
  // The bookkeeping map's counters: what a GPU worker of this island budget
  // would have hit and missed (no bytes move on this backend).
  void fill_expert_stats(protocol::StatsReply& r) const override {
    r.expert_hits = residency_.stats().hits;
    r.expert_misses = residency_.stats().misses;
    r.islands_used = uint32_t(residency_.stats().islands_in_use);
    r.islands_total = uint32_t(residency_.n_islands());
  }

 private:
  // The step's expert use, as a GPU worker would acquire and release them.
  void touch_experts(const std::vector<uint16_t>& counts) {  // [n_moe_layers * n_experts]
    const int E = residency_.n_experts();
    for (size_t i = 0; i < counts.size(); ++i) {
      if (counts[i] == 0) continue;
      const ExpertKey k{int(i) / E, int(i) % E};
      auto p = residency_.acquire(k);
      if (!p.ok()) continue;
      if (!p->hit) ++residency_version_;
      (void)residency_.unpin(k);
    }
  }

  ResidencyMap residency_;
  uint64_t residency_version_ = 0;

  std::unique_ptr<CpuEngine> engine_;
};

}  // namespace

Result<std::unique_ptr<Backend>> make_cpu_backend(const std::string& model_path, const EngineOptions& opts) {
  auto files = ModelFiles::open(model_path);
  if (!files.ok()) return make_error(files.error());
  auto engine = CpuEngine::create(files.value(), opts);
  if (!engine.ok()) return make_error(engine.error());
  const std::string id = model_id_from_path(model_path);
  return std::unique_ptr<Backend>(new CpuBackend(std::move(engine.value()), id));
}

}  // namespace moe::worker
