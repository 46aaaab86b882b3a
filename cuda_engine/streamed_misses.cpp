// Misses read by the kernels over the link (streamed passes), the host's
// share of them, and the host experts of copy mode: start-up and the
// bookkeeping around each pass.
#include "cuda_engine/engine_impl.h"

namespace moe {

Result<double> CudaEngine::Impl::measure_link_us() {
  if (opts.host_link_us > 0) return opts.host_link_us;
  const uint8_t* blob = arena->host_blob({0, 0});
  // Timing events, destroyed on every way out.
  struct Events {
    cudaEvent_t a = nullptr, b = nullptr;
    ~Events() {
      if (a) (void)cudaEventDestroy(a);
      if (b) (void)cudaEventDestroy(b);
    }
  } ev;
  MOE_CUDA_TRY(cudaEventCreate(&ev.a));
  MOE_CUDA_TRY(cudaEventCreate(&ev.b));
  float best = 1e30f;
  for (int i = 0; i < 4; ++i) {
    MOE_CUDA_TRY(cudaEventRecord(ev.a, st));
    MOE_CUDA_TRY(cudaMemcpyAsync(arena->island(0), blob, layout.blob_bytes, cudaMemcpyHostToDevice, st));
    MOE_CUDA_TRY(cudaEventRecord(ev.b, st));
    MOE_CUDA_TRY(cudaEventSynchronize(ev.b));
    float ms = 0;
    MOE_CUDA_TRY(cudaEventElapsedTime(&ms, ev.a, ev.b));
    best = std::min(best, ms);
  }
  return double(best) * 1000.0;
}

// Streamed decode passes under a budget: the host's cores take a share of
// each layer's misses (as many as finish no later than the link would with
// the rest, by the two rates measured here, fixed for the process so that
// its outputs do not follow timings).
Status CudaEngine::Impl::start_host_share() {
  const int hw = int(std::thread::hardware_concurrency());
  // Every core but two: the step thread's, which waits on the device
  // meanwhile, and one for the rest of the system (the team spins; a
  // descheduled member holds up every phase).
  const int threads = opts.host_threads > 0 ? opts.host_threads : hw - 2;
  if (threads < 2 || top_k > kShareMaxTopK) return {};
  const size_t slots = align_up(size_t(n_moe_layers) * sizeof(ShareSlot), 256);
  const size_t xs = align_up(size_t(n_moe_layers) * kShareMaxTokens * hidden * sizeof(bf16), 256);
  const size_t bytes = slots + xs + size_t(n_moe_layers) * kShareMaxTokens * hidden * sizeof(float);
  MOE_CUDA_TRY(cudaHostAlloc(reinterpret_cast<void**>(&share_host), bytes, cudaHostAllocMapped));
  std::memset(share_host, 0, bytes);
  uint8_t* dev = nullptr;
  MOE_CUDA_TRY(cudaHostGetDevicePointer(reinterpret_cast<void**>(&dev), share_host, 0));
  share_slots_dev = reinterpret_cast<ShareSlot*>(dev);
  share_x_dev = reinterpret_cast<bf16*>(dev + slots);
  share_sum_dev = reinterpret_cast<float*>(dev + slots + xs);
  MOE_CUDA_TRY(cudaMallocHost(reinterpret_cast<void**>(&pass_host), sizeof(uint32_t)));
  std::vector<const uint8_t*> blobs(size_t(n_moe_layers) * n_experts);
  for (int ml = 0; ml < n_moe_layers; ++ml)
    for (int e = 0; e < n_experts; ++e) blobs[size_t(ml) * n_experts + e] = arena->host_blob({ml, e});
  const ShareMemory mem{reinterpret_cast<ShareSlot*>(share_host), reinterpret_cast<uint16_t*>(share_host + slots),
                        reinterpret_cast<float*>(share_host + slots + xs)};
  share = std::make_unique<HostShare>(layout, n_moe_layers, n_experts, std::move(blobs), mem, threads);
  // The least of three measures a tenth of a second apart: the table stands
  // for the process's life, and the system may be busy just then (on the
  // GPU machine a measure right after another engine let go of its pinned
  // experts once took 6 ms an expert against 120-170 us).
  double host_us = opts.host_expert_us;
  if (host_us <= 0) {
    host_us = share->measure_us();
    for (int i = 1; i < 3; ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
      host_us = std::min(host_us, share->measure_us());
    }
  }
  auto link = measure_link_us();
  if (!link) return make_error(link.error());
  link_us = *link;
  // Row steps of whole down-projection groups and of the host's 64-input runs.
  const int step = std::lcm(64, layout.down.group);
  const std::vector<uint16_t> rows =
      share_rows_table(kShareMaxTokens * top_k, layout.inter, step, link_us, host_us, kShareFixedUs);
  if (opts.host_experts == HostShareMode::automatic && std::all_of(rows.begin(), rows.end(), [](uint16_t r) { return r == 0; })) {
    share.reset();  // the link alone is as quick: no team spinning for nothing
    for (void* p : {static_cast<void*>(share_host), static_cast<void*>(pass_host)}) (void)cudaFreeHost(p);
    share_host = nullptr;
    pass_host = nullptr;
    std::fprintf(stderr,
                 "moe-worker: streamed misses stay on the link (%.0f us an expert; the host's %d threads %.0f us)\n",
                 link_us, threads, host_us);
    return {};
  }
  MOE_CUDA_TRY(cudaMemcpy(share_rows, rows.data(), rows.size() * sizeof(uint16_t), cudaMemcpyHostToDevice));
  std::string t;
  for (size_t m = 1; m <= size_t(top_k); ++m) {
    if (m > 1) t += ' ';
    t += std::to_string(rows[m]);
  }
  std::fprintf(stderr,
               "moe-worker: streamed misses shared with %d host threads (%.0f us an expert; the link %.0f us): with "
               "1..%d missed pairs a layer the host computes the first %s of each one's %d rows\n",
               share->threads(), host_us, link_us, top_k, t.c_str(), layout.inter);
  return {};
}

// Under a budget: a pool for misses computed on the host, and the two rates
// the split weighs, measured here (this machine's link and cores, not a
// guess). Islands are still empty, so island 0 takes the timing copies.
Status CudaEngine::Impl::start_host_experts() {
  const int hw = int(std::thread::hardware_concurrency());
  const int threads = opts.host_threads > 0 ? opts.host_threads : hw;
  if (threads < 2) return {};  // one core: it has the step to drive
  host_x = std::make_unique<HostExperts>(layout, threads);
  MOE_CUDA_TRY(cudaMallocHost(reinterpret_cast<void**>(&xn_host), size_t(cuda::kGemvMaxTokens) * hidden * sizeof(bf16)));
  MOE_CUDA_TRY(cudaMallocHost(reinterpret_cast<void**>(&rw_host), size_t(cuda::kGemvMaxTokens) * top_k * 4));
  MOE_CUDA_TRY(cudaMallocHost(reinterpret_cast<void**>(&hsum_host), size_t(cuda::kGemvMaxTokens) * hidden * 4));
  MOE_CUDA_TRY(cudaMallocHost(reinterpret_cast<void**>(&split_ids_host), size_t(cuda::kGemvMaxTokens) * top_k * 4));
  // Experts spread over the layers: each timing run reads memory, as a miss does.
  std::vector<const uint8_t*> blobs;
  for (int i = 0; i < 16; ++i) blobs.push_back(arena->host_blob({(i * 7) % n_moe_layers, (i * 13) % n_experts}));
  host_us_token = host_x->measure_us(blobs);
  auto link = measure_link_us();
  if (!link) return make_error(link.error());
  link_us = *link;
  std::fprintf(stderr,
               "moe-worker: misses split between the link (%.0f us an expert) and %d host threads (%.0f us an "
               "expert-token)\n",
               link_us, host_x->threads(), host_us_token);
  return {};
}

Status CudaEngine::Impl::upload_stream_tables() {
  const size_t entries = size_t(n_moe_layers) * n_experts;
  for (int ml = 0; ml < n_moe_layers; ++ml)
    for (int e = 0; e < n_experts; ++e) {
      const int64_t i = map->lookup({ml, e});
      on_gpu_host[size_t(ml) * n_experts + e] = i >= 0 && tables_host[size_t(ml) * n_experts + e] == arena->island(i);
    }
  MOE_CUDA_TRY(cudaMemcpyAsync(blob_tables, tables_host, entries * sizeof(void*), cudaMemcpyHostToDevice, st));
  MOE_CUDA_TRY(cudaMemcpyAsync(on_gpu, on_gpu_host, entries, cudaMemcpyHostToDevice, st));
  return {};
}

Status CudaEngine::Impl::prepare_streamed_pass() {
  bool changed = false;
  if (stream_tables_stale) {
    // After copy-mode passes, warms or unloads: every copy they started has
    // landed, then each entry is its island or its host blob.
    MOE_TRY(arena->synchronize());
    for (int ml = 0; ml < n_moe_layers; ++ml)
      for (int e = 0; e < n_experts; ++e) {
        const int64_t i = map->lookup({ml, e});
        tables_host[size_t(ml) * n_experts + e] = i >= 0 ? arena->island(i) : arena->host_blob_on_device({ml, e});
      }
    admitted.clear();
    landing.clear();
    stream_tables_stale = false;
    changed = true;
  } else {
    // Copies started two passes ago have had a whole pass to land (a few
    // experts, ~50 us each): the pass waits for them, normally not at all,
    // and reads them from their islands. The last pass's admissions keep
    // streaming for one more pass, so a pass never waits on a fresh copy.
    for (const Landing& a : landing) {
      if (map->lookup(a.key) != a.island) continue;  // evicted again meanwhile
      MOE_TRY(arena->wait_copied(a.island, st));
      tables_host[size_t(a.key.layer) * n_experts + a.key.expert] = arena->island(a.island);
      changed = true;
    }
    landing.swap(admitted);
    admitted.clear();
  }
  return changed ? upload_stream_tables() : Status{};
}

Status CudaEngine::Impl::after_streamed_pass(int n) {
  // ids_host holds every layer's routes of the pass. An expert was a hit
  // when the pass read it from an island.
  std::vector<ExpertKey> streamed;
  int missed = 0;
  for (int ml = 0; ml < n_moe_layers; ++ml) {
    const std::vector<int> used = distinct_experts(ids_host + size_t(ml) * n * top_k, n * top_k, n_experts);
    const std::vector<int32_t>* host = sharing ? &share->taken(ml) : nullptr;
    for (int e : used) {
      const ExpertKey key{ml, e};
      const int64_t i = map->lookup(key);
      using Served = ResidencyMap::Served;
      Served how = Served::streamed;
      if (i >= 0 && tables_host[size_t(ml) * n_experts + e] == arena->island(i))
        how = Served::island;
      else if (host && std::find(host->begin(), host->end(), e) != host->end())
        how = Served::host;
      map->note_use(key, how);
      if (how == Served::island) continue;
      ++missed;
      if (how == Served::streamed) bytes_streamed += layout.blob_bytes;
      if (how == Served::host)  // the rows the host left streamed
        bytes_streamed += layout.blob_bytes * size_t(layout.inter - share->taken_rows(ml)) / size_t(layout.inter);
      if (i < 0) streamed.push_back(key);
    }
  }
  if (n <= kShareMaxTokens) share_misses[size_t(n)] = 0.9 * share_misses[size_t(n)] + 0.1 * double(missed) / double(n_moe_layers);
  // The streamed experts the policy finds worth an island, copied in now;
  // an evicted expert streams from the next pass on.
  int budget = opts.stream_admit_per_pass;
  for (const ExpertKey& key : streamed) {
    if (budget <= 0) break;
    const std::optional<Placement> p = map->admit(key);
    if (!p) continue;
    --budget;
    if (p->evicted)
      tables_host[size_t(p->evicted->layer) * n_experts + p->evicted->expert] = arena->host_blob_on_device(*p->evicted);
    MOE_TRY(arena->load(*p));
    admitted.push_back({key, p->island});
  }
  // Evictions: the next pass must not read those islands.
  return budget < opts.stream_admit_per_pass ? upload_stream_tables() : Status{};
}

}  // namespace moe
