#pragma once
// Programmatic dependent launch: a kernel in a decode step may start while
// the kernel before it drains. Every kernel of this library calls
// allow_next_grid() on entry and wait_prior_grid() before it touches
// anything an earlier kernel wrote (weights, which nothing writes, may be
// loaded before the wait). Both are no-ops for a plain launch.

#include <cuda_runtime.h>

#include <utility>

namespace moe::cuda::detail {

__device__ __forceinline__ void wait_prior_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void allow_next_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" :::);
#endif
}

// Launches `kernel` allowing it to overlap the previous kernel in `stream`.
template <typename... KArgs, typename... Args>
cudaError_t launch_pdl(void (*kernel)(KArgs...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                       Args&&... args) {
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = stream ? 1 : 0;  // the legacy default stream keeps plain ordering
  return cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...);
}

}  // namespace moe::cuda::detail
