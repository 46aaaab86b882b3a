// Making a layer's routed experts resident for its kernels (copy mode: the
// host reads the routes, copies misses in, or leaves them to the host's
// cores), and the public calls on residency.
#include "cuda_engine/engine_impl.h"

namespace moe {

Status CudaEngine::Impl::bind_experts(int ml, int n, const std::function<Status()>& meanwhile) {
  // The host needs the layer's routes to know what to fetch.
  const int32_t* ids_dev = route_ids + size_t(ml) * n * top_k;
  int32_t* ids = ids_host + size_t(ml) * n * top_k;
  MOE_CUDA_TRY(cudaMemcpyAsync(ids, ids_dev, size_t(n) * top_k * 4, cudaMemcpyDeviceToHost, st));
  const bool may_split = host_x && n <= cuda::kGemvMaxTokens;
  if (may_split) {  // what the host needs to compute experts itself, in the same wait
    MOE_CUDA_TRY(cudaMemcpyAsync(xn_host, xn, size_t(n) * hidden * sizeof(bf16), cudaMemcpyDeviceToHost, st));
    MOE_CUDA_TRY(cudaMemcpyAsync(rw_host, route_w, size_t(n) * top_k * 4, cudaMemcpyDeviceToHost, st));
  }
  MOE_CUDA_TRY(cudaEventRecord(routes_ready, st));
  MOE_TRY(meanwhile());
  MOE_CUDA_TRY(cudaEventSynchronize(routes_ready));
  stream_tables_stale = true;  // this pass moves experts without the streamed tables
  // bound[ml] lists exactly the experts pinned so far, so that a failure at
  // any point after can be undone by release_experts.
  std::vector<int>& pinned = bound[size_t(ml)];
  pinned.clear();
  std::vector<int> used = distinct_experts(ids, n * top_k, n_experts);
  host_pairs.clear();
  if (may_split) {
    // Misses (neither resident nor on their way) split between the link and
    // the host so that both finish about together.
    std::vector<MissCost> misses;
    for (int e : used)
      if (map->lookup({ml, e}) < 0) misses.push_back({e, int(std::count(ids, ids + size_t(n) * top_k, e))});
    const std::vector<int> on_host =
        misses.size() < 2 ? std::vector<int>{} : plan_split(misses, link_us, host_us_token, kHostFixedUs);
    if (!on_host.empty()) {
      for (int i = 0; i < n * top_k; ++i) {
        const bool host = std::find(on_host.begin(), on_host.end(), ids[i]) != on_host.end();
        split_ids_host[i] = host ? -1 : ids[i];
        if (host) host_pairs.push_back({i / top_k, arena->host_blob({ml, ids[i]}), rw_host[i]});
      }
      MOE_CUDA_TRY(cudaMemcpyAsync(split_ids, split_ids_host, size_t(n) * top_k * 4, cudaMemcpyHostToDevice, st));
      std::erase_if(used, [&](int e) { return std::find(on_host.begin(), on_host.end(), e) != on_host.end(); });
      host_experts_served += on_host.size();
      host_expert_tokens += host_pairs.size();
    }
  }
  const uint8_t** table = tables_host + size_t(ml) * n_experts;
  for (int e : used) {
    auto p = arena->request(*map, ml, e, st);
    if (!p) return make_error(p.error());
    table[e] = *p;
    pinned.push_back(e);
  }
  map->clear_predictions(ml);
  MOE_CUDA_TRY(cudaMemcpyAsync(blob_tables + size_t(ml) * n_experts, table, size_t(n_experts) * sizeof(void*), cudaMemcpyHostToDevice,
                               st));
  if (!opts.prefetch) return {};
  static_assert(std::is_same_v<int32_t, int>, "the predictor reads the ids in place");
  auto row = [&](int t) { return std::span<const int>(ids + size_t(t) * top_k, size_t(top_k)); };
  for (int t = 0; t < n; ++t) predictor->observe(ml, row(t));
  if (n_moe_layers < 2) return {};  // the next layer would be this one, in use
  // A pass this large uses (nearly) every expert of a layer whatever the
  // routing: an expert is left out with chance (1 - 1/E)^(nK) < e^-4 once
  // nK >= 4E (a prompt). Queue all of the next layer's experts behind this
  // layer's misses, so the link keeps moving while this layer computes.
  if (size_t(n) * top_k >= 4 * size_t(n_experts)) {
    std::vector<int> all(static_cast<size_t>(n_experts));
    std::iota(all.begin(), all.end(), 0);
    return arena->prefetch(*map, (ml + 1) % n_moe_layers, all, HintPriority::prefetch);
  }
  // The next MoE layer's likely experts, copied while this one computes:
  // its router's choice on this layer's state when guess_next_layer made
  // one, else the transition table's.
  std::vector<int> guess;
  auto add = [&](int e) {
    if (e >= 0 && e < n_experts && std::find(guess.begin(), guess.end(), e) == guess.end()) guess.push_back(e);
  };
  if (guess_tokens == n) {
    for (int i = 0; i < n * top_k; ++i) add(guess_ids_host[i]);
    ++router_guesses;
  } else {
    for (int t = 0; t < n; ++t)
      for (int e : predictor->predict_next(ml, row(t))) add(e);
  }
  guess_tokens = 0;
  if (guess.empty()) return {};
  return arena->prefetch(*map, (ml + 1) % n_moe_layers, guess, HintPriority::prefetch);
}

Status CudaEngine::Impl::guess_next_layer(int ml, int n) {
  guess_tokens = 0;
  // Prompts prefetch the whole next layer (bind_experts); the last layer's
  // next is the next token's first, which this state does not foretell.
  if (!opts.prefetch || opts.prefetch_guess != PrefetchGuess::router || n > cuda::kGemvMaxTokens ||
      ml + 1 >= n_moe_layers || size_t(n) * top_k >= 4 * size_t(n_experts))
    return {};
  const DevLayer& next = layers[size_t(layer_of_moe[size_t(ml + 1)])];
  const DenseW router = next.router_row >= 0 ? next.mlp_gu_w.slice(next.router_row, n_experts) : next.router_w;
  if (!router) return {};
  MOE_TRY(gemv_rmsnorm(router, x, next.post_norm, nullptr, guess_logits, n));
  MOE_TRY(cuda::router_topk(guess_logits, n, n_experts, top_k, d.moe.norm_topk_prob, d.moe.routed_scaling, guess_ids,
                            guess_w, st));
  MOE_CUDA_TRY(cudaMemcpyAsync(guess_ids_host, guess_ids, size_t(n) * top_k * 4, cudaMemcpyDeviceToHost, st));
  guess_tokens = n;
  return {};
}

// One expert blob over the link, µs (the best of four copies into island 0,
// which is still empty when this runs); opts.host_link_us overrides it.

Status CudaEngine::Impl::release_experts(int ml) {
  for (int e : bound[size_t(ml)])
    MOE_TRY(arena->release(*map, ml, e, st));
  bound[size_t(ml)].clear();
  return {};
}

size_t CudaEngine::warm(std::span<const ExpertKey> experts, bool may_evict) {
  Impl& m = *impl_;
  if (!m.map) return 0;
  size_t resident = 0;
  for (const ExpertKey& k : experts) {
    if (k.layer < 0 || k.layer >= m.n_moe_layers || k.expert < 0 || k.expert >= m.n_experts) continue;
    const int e = k.expert;
    if (m.map->lookup(k) < 0) {
      const HintPriority pr = may_evict ? HintPriority::prefetch : HintPriority::warm;
      if (Status s = m.arena->prefetch(*m.map, k.layer, std::span<const int>(&e, 1), pr); !s) {
        std::fprintf(stderr, "moe-worker: warming expert %d/%d failed: %s\n", k.layer, k.expert, s.error().c_str());
        continue;
      }
      if (m.map->lookup(k) >= 0) {
        ++m.residency_version;
        m.stream_tables_stale = true;
      }
    }
    if (m.map->lookup(k) >= 0) ++resident;
  }
  return resident;
}

Status CudaEngine::wait_for_copies() {
  Impl& m = *impl_;
  return m.arena ? m.arena->synchronize() : Status{};
}

void CudaEngine::seed_residency(int moe_layer, std::span<const double> rates) {
  Impl& m = *impl_;
  if (m.map && moe_layer >= 0 && moe_layer < m.n_moe_layers) m.map->seed(moe_layer, rates);
}

std::vector<ExpertKey> CudaEngine::unload(std::span<const ExpertKey> experts) {
  Impl& m = *impl_;
  // With every expert resident the pointer tables are fixed (and dropping
  // one would gain nothing): unloads are refused.
  if (!m.map || m.all_resident) return std::vector<ExpertKey>(experts.begin(), experts.end());
  std::vector<ExpertKey> failed;
  for (const ExpertKey& k : experts) {
    const bool was = k.layer >= 0 && k.layer < m.n_moe_layers && k.expert >= 0 && k.expert < m.n_experts && m.map->lookup(k) >= 0;
    if (Status s = m.map->drop(k); !s) {
      failed.push_back(k);
      continue;
    }
    if (was) {
      ++m.residency_version;
      m.stream_tables_stale = true;
    }
  }
  return failed;
}

std::vector<ExpertKey> CudaEngine::resident() const {
  std::vector<ExpertKey> out;
  const Impl& m = *impl_;
  if (!m.map) return out;
  for (int64_t i = 0; i < m.map->n_islands(); ++i)
    if (auto k = m.map->resident(i)) out.push_back(*k);
  std::sort(out.begin(), out.end(),
            [](const ExpertKey& a, const ExpertKey& b) { return a.layer != b.layer ? a.layer < b.layer : a.expert < b.expert; });
  return out;
}

uint64_t CudaEngine::residency_version() const {
  const Impl& m = *impl_;
  // Every copy into an island changes the resident set too.
  return m.residency_version + (m.map ? m.map->stats().copies() : 0);
}

std::string CudaEngine::device_error() const {
  // A sticky error poisons the context: every later call returns it.
  const cudaError_t e = cudaStreamSynchronize(impl_->st);
  if (e == cudaSuccess) return {};
  return std::string(cudaGetErrorName(e)) + ": " + cudaGetErrorString(e);
}

CudaExpertStats CudaEngine::expert_stats() const {
  CudaExpertStats s;
  const Impl& m = *impl_;
  if (m.map) s.residency = m.map->stats();
  s.islands_total = m.map ? m.map->n_islands() : m.plan.n_islands;
  s.islands_start = m.plan.n_islands;
  s.kv_grows = m.kv_grows;
  s.kv_give_backs = m.kv_shrinks;
  s.kv_islands_taken = m.kv_islands_taken;
  s.router_guesses = m.router_guesses;
  s.all_resident = m.all_resident;
  s.dense_weights = dense_name(m.dense);
  s.kv_dtype = m.kv_dtype == KvDtype::bf16 ? "bf16" : m.kv_dtype == KvDtype::int8 ? "int8" : "fp8";
  s.host_embedding = m.embed_host;
  s.host_experts_served = m.host_experts_served;
  s.host_expert_tokens = m.host_expert_tokens;
  s.host_share_served = m.share ? m.share->experts_served() : 0;
  if (m.share) s.share_times = m.share->times();
  s.experts_staged = m.experts_staged;
  s.bytes_streamed = m.bytes_streamed;
  s.fused_decode = m.fused_ok ? "on" : m.fused_why;
  s.fused_passes = m.fused_passes;
  if (m.fused.stamps && m.fused_passes > 0) {
    const int P = cuda::kFusedPhases, n = m.d.n_layers;
    std::vector<uint64_t> t(1 + size_t(n) * P * 2);
    if (cudaMemcpy(t.data(), m.fused.stamps, t.size() * 8, cudaMemcpyDeviceToHost) == cudaSuccess) {
      s.fused_phase_us.assign(size_t(2 * P), 0.0);
      for (int l = 0; l < n; ++l)
        for (int p = 0; p < P; ++p) {
          const size_t at = 1 + (size_t(l) * P + p) * 2;
          s.fused_phase_us[size_t(2 * p)] += double(t[at] - t[at - 1]) / 1e3 / n;
          s.fused_phase_us[size_t(2 * p + 1)] += double(t[at + 1] - t[at]) / 1e3 / n;
        }
    }
  }
  return s;
}

}  // namespace moe
