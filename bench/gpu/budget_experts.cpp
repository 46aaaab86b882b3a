#include "bench/gpu/budget_experts.h"

#include <algorithm>
#include <cstring>

#include "gpu_worker/eviction_policy.h"
#include "gpu_worker/island_plan.h"
#include "kernels/cuda/cuda_check.cuh"

namespace moe::bench {

Result<std::unique_ptr<BudgetExperts>> BudgetExperts::create(const BudgetOptions& o) {
  std::unique_ptr<BudgetExperts> b(new BudgetExperts());
  b->o_ = o;
  b->rng_.seed(o.seed);
  IslandPlanRequest req;
  req.budget_bytes = o.islands_bytes;
  req.kv_bytes_per_block = 256;  // KV lives outside this arena in the benchmark
  req.expert_blob_bytes = o.blob_bytes;
  req.n_total_experts = int64_t(o.n_layers) * o.n_experts;
  // A prompt can route to every expert of a layer: all of them pinned at once.
  req.min_islands = o.n_experts;
  auto plan = plan_islands(req);
  if (!plan) return make_error(plan.error());

  ExpertHostSource src;
  src.n_layers = o.n_layers;
  src.n_experts = o.n_experts;
  src.blob_bytes = o.blob_bytes;
  src.blobs.resize(size_t(o.n_layers) * o.n_experts);
  for (size_t k = 0; k < src.blobs.size(); ++k) src.blobs[k] = o.host_experts + k * o.blob_bytes;
  auto arena = IslandArena::create(*plan, src);
  if (!arena) return make_error(arena.error());
  b->arena_ = std::move(*arena);

  std::unique_ptr<EvictionPolicy> pol;
  if (o.policy == "lru")
    pol = std::make_unique<LruPolicy>();
  else if (o.policy == "lfu")
    pol = std::make_unique<LfuDecayPolicy>();
  else if (o.policy == "ours")
    pol = std::make_unique<OursPolicy>();
  else
    return make_error("unknown policy " + o.policy + " (lru, lfu, ours)");
  b->map_ = std::make_unique<ResidencyMap>(o.n_layers, o.n_experts, plan->n_islands, o.blob_bytes,
                                           std::move(pol));

  b->pack_bytes_ =
      (size_t(o.n_experts) * sizeof(void*) + size_t(o.max_tokens) * o.top_k * 4 + 255) / 256 * 256;
  MOE_CUDA_TRY(
      cudaMallocHost(reinterpret_cast<void**>(&b->pack_host_), b->pack_bytes_ * o.n_layers));
  MOE_CUDA_TRY(cudaMalloc(reinterpret_cast<void**>(&b->pack_dev_), b->pack_bytes_ * o.n_layers));
  std::memset(b->pack_host_, 0, b->pack_bytes_ * o.n_layers);
  MOE_CUDA_TRY(cudaEventCreateWithFlags(&b->routed_, cudaEventDisableTiming));
  b->bound_.resize(size_t(o.n_layers));
  b->layer_read_.assign(size_t(o.n_layers), nullptr);
  b->batch_done_.assign(size_t(o.n_layers), nullptr);
  for (int l = 0; l < o.n_layers; ++l) {
    MOE_CUDA_TRY(cudaEventCreateWithFlags(&b->layer_read_[size_t(l)], cudaEventDisableTiming));
    MOE_CUDA_TRY(cudaEventCreateWithFlags(&b->batch_done_[size_t(l)], cudaEventDisableTiming));
  }
  return Result<std::unique_ptr<BudgetExperts>>(std::move(b));
}

BudgetExperts::~BudgetExperts() {
  arena_.reset();  // waits for its copies first
  if (routed_) (void)cudaEventDestroy(routed_);
  for (cudaEvent_t e : layer_read_)
    if (e) (void)cudaEventDestroy(e);
  for (cudaEvent_t e : batch_done_)
    if (e) (void)cudaEventDestroy(e);
  if (pack_dev_) (void)cudaFree(pack_dev_);
  if (pack_host_) (void)cudaFreeHost(pack_host_);
}

void BudgetExperts::draw_routes(int tokens, std::vector<int32_t>& out) {
  out.resize(size_t(tokens) * o_.top_k);
  std::uniform_int_distribution<int> pick(0, o_.n_experts - 1);
  for (int t = 0; t < tokens; ++t) {
    int32_t* r = out.data() + size_t(t) * o_.top_k;
    for (int k = 0; k < o_.top_k; ++k) {
      int e;
      do e = pick(rng_);
      while (std::find(r, r + k, e) != r + k);  // top-k picks are distinct
      r[k] = e;
    }
  }
}

Result<ExpertBinding> BudgetExperts::bind(int layer, int tokens, cudaStream_t st) {
  // The host learns layer's routes only once the GPU has run its router.
  MOE_CUDA_TRY(cudaEventRecord(routed_, st));
  MOE_CUDA_TRY(cudaEventSynchronize(routed_));
  if (layer == 0 || !have_next_) ahead_.clear();
  if (ahead_.empty()) {
    draw_routes(tokens, cur_);
  } else {
    cur_.swap(ahead_.front());
    ahead_.erase(ahead_.begin());
  }

  uint8_t* host = pack_host_ + size_t(layer) * pack_bytes_;
  uint8_t* dev = pack_dev_ + size_t(layer) * pack_bytes_;
  auto* table = reinterpret_cast<const uint8_t**>(host);
  auto* ids = reinterpret_cast<int32_t*>(host + size_t(o_.n_experts) * sizeof(void*));
  std::vector<int>& used = bound_[size_t(layer)];
  used.clear();
  for (int32_t e : cur_)
    if (std::find(used.begin(), used.end(), e) == used.end()) used.push_back(e);
  for (int e : used) {
    auto p = arena_->request(*map_, layer, e, st);
    if (!p) return make_error(p.error());
    table[e] = *p;
  }
  // Islands a batch filled for this layer: the map calls them hits, so the
  // arena's per-island events do not cover them; the batch's event does.
  if (o_.batched_prefetch) MOE_CUDA_TRY(cudaStreamWaitEvent(st, batch_done_[size_t(layer)], 0));
  map_->clear_predictions(layer);
  std::memcpy(ids, cur_.data(), cur_.size() * 4);
  const size_t bytes = size_t(o_.n_experts) * sizeof(void*) + cur_.size() * 4;
  MOE_CUDA_TRY(cudaMemcpyAsync(dev, host, bytes, cudaMemcpyHostToDevice, st));

  // The next layers' experts, guessed now and copied while l computes.
  have_next_ = false;
  const int look = tokens > 8 ? std::max(1, o_.prefill_lookahead) : 1;
  for (int d = 1; d <= look && layer + d < o_.n_layers; ++d) {
    if (int(ahead_.size()) < d) {
      ahead_.emplace_back();
      draw_routes(tokens, ahead_.back());
    }
    have_next_ = true;
    if (o_.predict_accuracy <= 0) continue;
    const std::vector<int32_t>& nx = ahead_[size_t(d - 1)];
    std::uniform_real_distribution<double> u(0.0, 1.0);
    std::uniform_int_distribution<int> pick(0, o_.n_experts - 1);
    std::vector<int> guess;
    for (size_t t = 0; t < nx.size(); t += size_t(o_.top_k)) {
      const int32_t* r = nx.data() + t;
      for (int k = 0; k < o_.top_k; ++k) {
        int e = r[k];
        if (u(rng_) >= o_.predict_accuracy) {
          do e = pick(rng_);
          while (std::find(r, r + o_.top_k, e) != r + o_.top_k);
        }
        if (std::find(guess.begin(), guess.end(), e) == guess.end()) guess.push_back(e);
      }
    }
    const Status s = o_.batched_prefetch
                         ? prefetch_batch(layer + d, guess)
                         : arena_->prefetch(*map_, layer + d, guess, HintPriority::prefetch);
    if (!s) return make_error(s.error());
  }
  ExpertBinding out;
  out.blobs = reinterpret_cast<const uint8_t* const*>(dev);
  out.ids = reinterpret_cast<const int32_t*>(dev + size_t(o_.n_experts) * sizeof(void*));
  return out;
}

Status BudgetExperts::unbind(int layer, cudaStream_t st) {
  for (int e : bound_[size_t(layer)])
    if (Status s = arena_->release(*map_, layer, e, st); !s) return s;
  MOE_CUDA_TRY(cudaEventRecord(layer_read_[size_t(layer)], st));
  return {};
}

Status BudgetExperts::prefetch_batch(int layer, const std::vector<int>& experts) {
  const std::vector<Placement> ps = map_->hint(layer, experts, HintPriority::prefetch);
  if (ps.empty()) return {};
  cudaStream_t cs = arena_->copy_stream();
  // An evicted expert was last read by its layer's latest expert kernels.
  std::vector<int> waited;
  for (const Placement& p : ps)
    if (p.evicted && std::find(waited.begin(), waited.end(), p.evicted->layer) == waited.end()) {
      waited.push_back(p.evicted->layer);
      MOE_CUDA_TRY(cudaStreamWaitEvent(cs, layer_read_[size_t(p.evicted->layer)], 0));
    }
  for (const Placement& p : ps) {
    const uint8_t* src =
        o_.host_experts +
        (size_t(p.key.layer) * o_.n_experts + size_t(p.key.expert)) * o_.blob_bytes;
    MOE_CUDA_TRY(
        cudaMemcpyAsync(arena_->island(p.island), src, o_.blob_bytes, cudaMemcpyHostToDevice, cs));
  }
  MOE_CUDA_TRY(cudaEventRecord(batch_done_[size_t(layer)], cs));
  return {};
}

}  // namespace moe::bench
