#include "residency/island_arena.h"

#include <cuda_runtime.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <string>

#include "kernels/cuda/cuda_check.cuh"

namespace moe {

namespace {

// Pinning the blobs where they lie avoids a second host copy of every expert,
// but only makes sense when they sit together (a packed file's expert region).
bool blobs_form_one_range(const ExpertHostSource& src, uintptr_t* lo, uintptr_t* hi) {
  *lo = UINTPTR_MAX;
  *hi = 0;
  for (const uint8_t* b : src.blobs) {
    if (!b) return false;
    *lo = std::min(*lo, uintptr_t(b));
    *hi = std::max(*hi, uintptr_t(b) + src.blob_bytes);
  }
  return *hi > *lo && (*hi - *lo) <= 2 * src.blobs.size() * src.blob_bytes;
}

}  // namespace

Result<std::unique_ptr<IslandArena>> IslandArena::create(const IslandPlan& plan,
                                                         const ExpertHostSource& src) {
  if (src.blobs.size() != size_t(src.n_layers) * size_t(src.n_experts) || src.blobs.empty())
    return make_error("island arena: expected " + std::to_string(src.n_layers) + " x " +
                      std::to_string(src.n_experts) + " expert blobs, got " +
                      std::to_string(src.blobs.size()));
  if (src.blob_bytes != plan.expert_blob_bytes || plan.island_stride < src.blob_bytes)
    return make_error("island arena: expert blobs of " + std::to_string(src.blob_bytes) +
                      " bytes, plan made for " + std::to_string(plan.expert_blob_bytes));
  std::unique_ptr<IslandArena> a(new IslandArena());
  a->plan_ = plan;
  a->n_experts_ = src.n_experts;

  // The one device allocation of the worker's life.
  MOE_CUDA_TRY(cudaMalloc(reinterpret_cast<void**>(&a->base_), plan.arena_bytes));
  MOE_CUDA_TRY(cudaStreamCreateWithFlags(&a->copy_stream_, cudaStreamNonBlocking));
  a->copied_.assign(size_t(plan.n_islands), nullptr);
  a->read_done_.assign(size_t(plan.n_islands), nullptr);
  for (int64_t i = 0; i < plan.n_islands; ++i) {
    MOE_CUDA_TRY(cudaEventCreateWithFlags(&a->copied_[size_t(i)], cudaEventDisableTiming));
    MOE_CUDA_TRY(cudaEventCreateWithFlags(&a->read_done_[size_t(i)], cudaEventDisableTiming));
  }

  uintptr_t lo = 0, hi = 0;
  if (src.pinned_base) {
    a->host_ = src.blobs;
  } else if (blobs_form_one_range(src, &lo, &hi)) {
    const uintptr_t page = uintptr_t(sysconf(_SC_PAGESIZE));
    const uintptr_t start = lo / page * page, end = (hi + page - 1) / page * page;
    // Read-only: a packed file is mapped PROT_READ.
    const cudaError_t e = cudaHostRegister(reinterpret_cast<void*>(start), end - start,
                                           cudaHostRegisterPortable | cudaHostRegisterMapped |
                                                                        cudaHostRegisterReadOnly);
    if (e == cudaSuccess)
      a->registered_base_ = reinterpret_cast<void*>(start);
    else
      (void)cudaGetLastError();  // fall back to a page-locked copy below
  }
  if (src.pinned_base) {
    // used as it is
  } else if (a->registered_base_) {
    a->host_ = src.blobs;
  } else {
    const size_t total = src.blobs.size() * src.blob_bytes;
    MOE_CUDA_TRY(cudaMallocHost(reinterpret_cast<void**>(&a->staging_), total));
    a->host_.resize(src.blobs.size());
    for (size_t k = 0; k < src.blobs.size(); ++k) {
      std::memcpy(a->staging_ + k * src.blob_bytes, src.blobs[k], src.blob_bytes);
      a->host_[k] = a->staging_ + k * src.blob_bytes;
    }
  }
  // The device's address of every pinned blob: the kernels read a streamed
  // miss through it over the link.
  uint8_t* host_base = src.pinned_base        ? const_cast<uint8_t*>(src.pinned_base)
                       : a->registered_base_ ? static_cast<uint8_t*>(a->registered_base_)
                                             : a->staging_;
  void* dev_base = nullptr;
  MOE_CUDA_TRY(cudaHostGetDevicePointer(&dev_base, host_base, 0));
  a->host_dev_.resize(a->host_.size());
  for (size_t k = 0; k < a->host_.size(); ++k)
    a->host_dev_[k] = static_cast<const uint8_t*>(dev_base) + (a->host_[k] - host_base);
  return a;
}

IslandArena::~IslandArena() {
  // Errors cannot be returned from here; the process is tearing down the arena.
  if (copy_stream_) (void)cudaStreamSynchronize(copy_stream_);
  for (CUevent_st* e : copied_)
    if (e) (void)cudaEventDestroy(e);
  for (CUevent_st* e : read_done_)
    if (e) (void)cudaEventDestroy(e);
  if (copy_stream_) (void)cudaStreamDestroy(copy_stream_);
  if (base_) (void)cudaFree(base_);
  if (registered_base_) (void)cudaHostUnregister(registered_base_);
  if (staging_) (void)cudaFreeHost(staging_);
}

const uint8_t* IslandArena::host_blob(ExpertKey k) const {
  return host_[size_t(k.layer) * size_t(n_experts_) + size_t(k.expert)];
}

const uint8_t* IslandArena::host_blob_on_device(ExpertKey k) const {
  return host_dev_[size_t(k.layer) * size_t(n_experts_) + size_t(k.expert)];
}

Status IslandArena::load(const Placement& p) { return copy_into(p); }

Status IslandArena::wait_copied(int64_t island, GpuStream compute) {
  MOE_CUDA_TRY(cudaStreamWaitEvent(compute, copied_[size_t(island)], 0));
  return {};
}

Status IslandArena::copy_into(const Placement& p) {
  const size_t i = size_t(p.island);
  // The island's previous expert may still be read by compute enqueued earlier.
  MOE_CUDA_TRY(cudaStreamWaitEvent(copy_stream_, read_done_[i], 0));
  MOE_CUDA_TRY(cudaMemcpyAsync(island(p.island), host_blob(p.key), plan_.expert_blob_bytes,
                               cudaMemcpyHostToDevice, copy_stream_));
  MOE_CUDA_TRY(cudaEventRecord(copied_[i], copy_stream_));
  ++copies_;
  return {};
}

Result<const uint8_t*> IslandArena::request(ResidencyMap& map, int layer, int expert,
                                            GpuStream compute) {
  auto p = map.acquire({layer, expert});
  if (!p) return make_error(p.error());
  if (!p->hit)
    if (Status s = copy_into(*p); !s) return make_error(s.error());
  MOE_CUDA_TRY(cudaStreamWaitEvent(compute, copied_[size_t(p->island)], 0));
  return static_cast<const uint8_t*>(island(p->island));
}

Status IslandArena::prefetch(ResidencyMap& map, int layer, std::span<const int> experts,
                             HintPriority priority) {
  for (const Placement& p : map.hint(layer, experts, priority))
    if (Status s = copy_into(p); !s) return s;
  return {};
}

Status IslandArena::release(ResidencyMap& map, int layer, int expert, GpuStream compute) {
  const int64_t i = map.lookup({layer, expert});
  if (i < 0) return make_error("island arena: release of a non-resident expert");
  MOE_CUDA_TRY(cudaEventRecord(read_done_[size_t(i)], compute));
  return map.unpin({layer, expert});
}

Status IslandArena::synchronize() {
  MOE_CUDA_TRY(cudaStreamSynchronize(copy_stream_));
  return {};
}

}  // namespace moe
