// KV blocks and expert islands trading places at run time
// (docs/kv-islands-trade.md): the pool grows down into the islands nearest
// the arena's top when a step needs more blocks than are free (and a chunk
// ahead when few are left), and gives the grown part back once it has been
// mostly free for a while. Nothing is allocated; the boundary moves.
#include <chrono>

#include "cuda_engine/engine_impl.h"

namespace moe {

namespace {
uint64_t steady_ms() {
  return uint64_t(std::chrono::duration_cast<std::chrono::milliseconds>(
                      std::chrono::steady_clock::now().time_since_epoch())
                      .count());
}
}  // namespace

int CudaEngine::Impl::kv_growable() const {
  if (!kv_trade) return 0;
  return int(std::max<int64_t>(0, kv_reachable - kv_pool->total()));
}

Status CudaEngine::Impl::grow_kv(int need) {
  const int room = kv_growable();
  if (need <= 0) return {};
  if (need > room)
    return make_error("KV cache: " + std::to_string(need) + " more blocks needed, only " + std::to_string(room) +
                      " can be taken from the expert islands");
  const int before = kv_pool->total();
  const int n = std::min(room, std::max(need, kKvGrowChunk));
  const int64_t islands_before = map->n_islands();
  const int64_t keep = plan.islands_with_kv(int64_t(before) + n);
  if (keep < islands_before) {
    // Nothing may read or write the islands that go: the compute of the
    // last step and every copy in flight end first. Between steps no
    // expert is pinned, so retiring cannot be refused.
    MOE_CUDA_TRY(cudaStreamSynchronize(st));
    MOE_TRY(arena->synchronize());
    auto gone = map->retire_islands(keep);
    if (!gone) return make_error(gone.error());
    kv_islands_taken += uint64_t(gone->size());
    stream_tables_stale = true;  // their experts stream from the host again
    ++residency_version;
  }
  kv_pool->grow(n);
  ++kv_grows;
  std::fprintf(stderr, "moe-worker: KV grew by %d blocks to %d (%d tokens); expert islands %lld -> %lld\n", n,
               kv_pool->total(), kv_pool->total() * kBlockTokens, (long long)islands_before, (long long)keep);
  return {};
}

void CudaEngine::Impl::kv_after_step() {
  // Ahead of need: the next long prompt then does not wait on evictions.
  if (kv_growable() <= 0 || kv_pool->free() * 10 >= kv_pool->total()) return;
  if (Status s = grow_kv(std::min(kKvGrowChunk, kv_growable())); !s.ok())
    std::fprintf(stderr, "moe-worker: growing the KV cache ahead failed: %s\n", s.error().c_str());
}

void CudaEngine::Impl::kv_idle() {
  if (!kv_trade || kv_pool->total() <= kv_floor || kv_pool->free() * 2 <= kv_pool->total()) {
    kv_roomy_since_ms = 0;
    return;
  }
  const uint64_t now = steady_ms();
  if (kv_roomy_since_ms == 0) kv_roomy_since_ms = now;
  if (now - kv_roomy_since_ms < uint64_t(opts.kv_give_back_s) * 1000) return;
  // Leave a quarter of the pool free: used = 3/4 of the new total. Held
  // blocks near the top stop it short; it tries again every idle tick (new
  // sequences take the lowest free ids, so the top empties as they end).
  const int used = kv_pool->total() - kv_pool->free();
  const int target = std::max(kv_floor, (used * 4 + 2) / 3);
  if (target >= kv_pool->total()) return;
  if (cudaStreamSynchronize(st) != cudaSuccess) return;  // the step's own check reports a broken device
  const int before = kv_pool->total();
  const int after = kv_pool->shrink_free_tail(target, kv_floor);
  if (after >= before) return;
  kv_roomy_since_ms = 0;
  const int64_t islands_before = map->n_islands();
  map->restore_islands(plan.islands_with_kv(after));
  stream_tables_stale = true;
  ++kv_shrinks;
  std::fprintf(stderr, "moe-worker: KV gave back %d idle blocks, now %d; expert islands %lld -> %lld\n",
               before - after, after, (long long)islands_before, (long long)map->n_islands());
}

int CudaEngine::kv_blocks_growable() const { return impl_->kv_growable(); }
void CudaEngine::idle() { impl_->kv_idle(); }

}  // namespace moe
