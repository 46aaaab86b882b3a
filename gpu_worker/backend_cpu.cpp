// The CPU backend: protocol steps onto moe::CpuEngine.
#include <algorithm>
#include <chrono>
#include <filesystem>
#include <span>
#include <unordered_set>

#include "engine/engine.h"
#include "gpu_worker/backend.h"
#include "gpu_worker/model_hello.h"
#include "gpu_worker/residency.h"

namespace moe::worker {
namespace {

using protocol::ErrorCode;

class CpuBackend final : public Backend {
 public:
  CpuBackend(std::unique_ptr<CpuEngine> engine, std::string model_id)
      : residency_(engine->desc().n_moe_layers(), engine->desc().moe.n_experts,
                   cpu_islands(engine->desc().n_moe_layers(), engine->desc().moe.n_experts), 0,
                   std::make_unique<LruPolicy>()),
        engine_(std::move(engine)),
        model_id_(std::move(model_id)) {}

  // A quarter of all experts, as a small GPU's island budget would hold.
  static int64_t cpu_islands(int moe_layers, int experts) {
    return std::max<int64_t>(1, int64_t(moe_layers) * experts / 4);
  }

  protocol::Hello describe() const override {
    protocol::Hello h = model_hello(engine_->desc());
    h.model_id = model_id_;
    h.backend = "cpu";
    h.instance = "moe-worker";
    h.kv_blocks_total = uint32_t(engine_->kv_blocks_total());
    h.kv_block_tokens = uint32_t(engine_->kv_block_tokens());
    h.max_context = uint32_t(engine_->max_context());
    return h;
  }

  protocol::StepReply step(const protocol::StepRequest& req) override {
    const auto t0 = std::chrono::steady_clock::now();
    protocol::StepReply reply;
    reply.results.resize(req.sequences.size());
    // Sequences the engine would refuse get their own error; the rest run
    // together (the engine refuses a whole step on any inconsistency).
    std::vector<SeqInput> inputs;
    std::vector<size_t> result_of;  // [inputs]: index into reply.results
    std::unordered_set<uint64_t> seen;
    const int vocab = engine_->desc().vocab_size;
    int need_blocks = 0;
    for (size_t i = 0; i < req.sequences.size(); ++i) {
      const protocol::StepSequence& s = req.sequences[i];
      protocol::StepResult& r = reply.results[i];
      r.seq_id = s.seq_id;
      auto fail = [&](ErrorCode code, std::string msg) {
        r.error = code;
        r.error_message = std::move(msg);
      };
      if (s.seq_id == 0) { fail(ErrorCode::invalid_argument, "sequence id 0 is reserved"); continue; }
      if (!seen.insert(s.seq_id).second) { fail(ErrorCode::invalid_argument, "sequence appears twice in the step"); continue; }
      if (s.tokens.empty()) { fail(ErrorCode::invalid_argument, "no tokens"); continue; }
      if (std::any_of(s.tokens.begin(), s.tokens.end(), [&](int32_t t) { return t < 0 || t >= vocab; })) {
        fail(ErrorCode::invalid_argument, "token id out of range");
        continue;
      }
      const int have = engine_->seq_length(s.seq_id);
      if (s.start_pos != 0 && int64_t(s.start_pos) != have) {
        fail(have < 0 ? ErrorCode::unknown_sequence : ErrorCode::invalid_argument,
             "start_pos " + std::to_string(s.start_pos) + " but the worker holds " + std::to_string(std::max(have, 0)) +
                 " tokens");
        continue;
      }
      const int64_t end = int64_t(s.start_pos) + int64_t(s.tokens.size());
      if (end > engine_->max_context()) {
        fail(ErrorCode::limit_exceeded, std::to_string(end) + " tokens exceed the context of " +
                                            std::to_string(engine_->max_context()));
        continue;
      }
      const int bt = engine_->kv_block_tokens();
      const int held = s.start_pos == 0 ? 0 : (std::max(have, 0) + bt - 1) / bt;
      const int extra = int((end + bt - 1) / bt) - held;
      const int freed = s.start_pos == 0 && have > 0 ? (have + bt - 1) / bt : 0;
      if (need_blocks + extra > engine_->kv_blocks_free() + freed) {
        fail(ErrorCode::out_of_kv_blocks, "the KV cache has too few free blocks for this sequence");
        continue;
      }
      need_blocks += extra - freed;
      SeqInput in;
      in.seq_id = s.seq_id;
      in.tokens = s.tokens;
      in.start_pos = int32_t(s.start_pos);
      in.sample = s.sample;
      in.sampling.temperature = s.sampling.temperature;
      in.sampling.top_p = s.sampling.top_p;
      in.sampling.top_k = int(s.sampling.top_k);
      in.sampling.seed = s.sampling.seed;
      in.sampling.logprobs = s.sampling.logprobs;
      in.sampling.top_logprobs = s.sampling.top_logprobs;
      inputs.push_back(std::move(in));
      result_of.push_back(i);
    }
    const auto t1 = std::chrono::steady_clock::now();
    if (!inputs.empty()) {
      auto out = engine_->step(std::span<const SeqInput>(inputs));
      for (size_t k = 0; k < inputs.size(); ++k) {
        protocol::StepResult& r = reply.results[result_of[k]];
        if (!out.ok()) {
          r.error = ErrorCode::internal;
          r.error_message = out.error();
          continue;
        }
        const SeqOutput& o = (*out)[k];
        r.sampled = o.token >= 0;
        r.token = std::max(o.token, 0);
        r.logprob = o.logprob;
        for (const auto& [tok, lp] : o.top) r.top.push_back({tok, lp});
        touch_experts(o.expert_counts);
        if (req.report_expert_usage) r.expert_usage = o.expert_counts;
        r.kv_tokens = uint32_t(std::max(engine_->seq_length(o.seq_id), 0));
        live_.insert(o.seq_id);
      }
    }
    for (auto& r : reply.results)
      if (r.error != ErrorCode::none) r.kv_tokens = uint32_t(std::max(engine_->seq_length(r.seq_id), 0));
    const auto t2 = std::chrono::steady_clock::now();
    reply.timing.compute_us = uint32_t(std::chrono::duration_cast<std::chrono::microseconds>(t2 - t1).count());
    reply.timing.total_us = uint32_t(std::chrono::duration_cast<std::chrono::microseconds>(t2 - t0).count());
    reply.kv_blocks_free = uint32_t(engine_->kv_blocks_free());
    reply.kv_blocks_used = uint32_t(engine_->kv_blocks_total() - engine_->kv_blocks_free());
    return reply;
  }

  void release(uint64_t seq_id) override {
    engine_->release(seq_id);
    live_.erase(seq_id);
  }
  int kv_blocks_total() const override { return engine_->kv_blocks_total(); }
  int kv_blocks_free() const override { return engine_->kv_blocks_free(); }
  int sequences_active() const override { return int(live_.size()); }

  // Residency on this backend: every expert is readable from the mapped
  // model, so the map is bookkeeping of the experts a GPU worker of the same
  // island budget would hold (what is reported, published and re-warmed).
  size_t warm(const std::vector<protocol::ExpertRef>& experts) override {
    size_t resident = 0;
    for (const protocol::ExpertRef& e : experts) {
      if (e.layer >= residency_.n_layers() || e.expert >= residency_.n_experts()) continue;
      const int expert = e.expert;
      const auto placed = residency_.hint(e.layer, std::span<const int>(&expert, 1), HintPriority::warm);
      if (!placed.empty()) ++residency_version_;
      if (residency_.lookup({e.layer, e.expert}) >= 0) ++resident;
    }
    return resident;
  }
  std::vector<protocol::ExpertRef> resident() const override {
    std::vector<protocol::ExpertRef> out;
    for (int64_t i = 0; i < residency_.n_islands(); ++i)
      if (auto k = residency_.resident(i)) out.push_back({uint16_t(k->layer), uint16_t(k->expert)});
    std::sort(out.begin(), out.end(),
              [](const auto& a, const auto& b) { return a.layer != b.layer ? a.layer < b.layer : a.expert < b.expert; });
    return out;
  }
  uint64_t residency_version() const override { return residency_version_; }

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
  std::string model_id_;
  std::unordered_set<uint64_t> live_;  // sequences holding KV
};

}  // namespace

Result<std::unique_ptr<Backend>> make_cpu_backend(const std::string& model_path, const CpuBackendOptions& opts) {
  auto files = ModelFiles::open(model_path);
  if (!files.ok()) return make_error(files.error());
  EngineOptions eo;
  eo.threads = opts.threads;
  eo.kv_blocks = opts.kv_blocks;
  auto engine = CpuEngine::create(files.value(), eo);
  if (!engine.ok()) return make_error(engine.error());
  std::filesystem::path p(model_path);
  std::string id = p.filename().string();
  if (id.empty()) id = p.parent_path().filename().string();
  return std::unique_ptr<Backend>(new CpuBackend(std::move(engine.value()), id));
}

}  // namespace moe::worker
