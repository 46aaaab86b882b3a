#pragma once
// CUDA test cases run only where a device exists: without one a case prints
// "SKIPPED: no CUDA device", warns, and passes (CI has nvcc but no GPU).

#include <cstdio>

#include "kernels/cuda/cuda_check.cuh"

#define SKIP_WITHOUT_GPU()                  \
  do {                                      \
    if (!moe::cuda::device_present()) {     \
      std::puts("SKIPPED: no CUDA device"); \
      WARN("SKIPPED: no CUDA device");      \
      return;                               \
    }                                       \
  } while (0)
