#pragma once
// The one error path of the CUDA kernels: every CUDA runtime and cuBLASLt
// call goes through MOE_CUDA_TRY / MOE_CUBLAS_TRY, which turn a failure into
// a moe::Error naming the statement, function, file and line, and return it
// from the enclosing function (which returns moe::Status or moe::Result<T>).
// Nothing here exits the process.

#include <cublasLt.h>
#include <cuda_runtime.h>

#include <string>

#include "model/result.h"

namespace moe::cuda {

inline Error cuda_error_at(const char* stmt, const char* what, const char* func,
                           const char* file, int line) {
  return make_error(std::string(what) + " in `" + stmt + "` (" + func + ", " + file + ":" +
                    std::to_string(line) + ")");
}

inline const char* cublas_status_name(cublasStatus_t s) {
  switch (s) {
    case CUBLAS_STATUS_SUCCESS: return "CUBLAS_STATUS_SUCCESS";
    case CUBLAS_STATUS_NOT_INITIALIZED: return "CUBLAS_STATUS_NOT_INITIALIZED";
    case CUBLAS_STATUS_ALLOC_FAILED: return "CUBLAS_STATUS_ALLOC_FAILED";
    case CUBLAS_STATUS_INVALID_VALUE: return "CUBLAS_STATUS_INVALID_VALUE";
    case CUBLAS_STATUS_ARCH_MISMATCH: return "CUBLAS_STATUS_ARCH_MISMATCH";
    case CUBLAS_STATUS_EXECUTION_FAILED: return "CUBLAS_STATUS_EXECUTION_FAILED";
    case CUBLAS_STATUS_INTERNAL_ERROR: return "CUBLAS_STATUS_INTERNAL_ERROR";
    case CUBLAS_STATUS_NOT_SUPPORTED: return "CUBLAS_STATUS_NOT_SUPPORTED";
    default: return "cuBLAS error";
  }
}

// True when at least one CUDA device can be used (tests skip otherwise).
inline bool device_present() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

}  // namespace moe::cuda

#define MOE_CUDA_TRY(stmt)                                                             \
  do {                                                                                 \
    cudaError_t moe_err_ = (stmt);                                                     \
    if (moe_err_ != cudaSuccess)                                                       \
      return ::moe::cuda::cuda_error_at(#stmt, cudaGetErrorString(moe_err_), __func__, \
                                        __FILE__, __LINE__);                           \
  } while (0)

#define MOE_CUBLAS_TRY(stmt)                                                                \
  do {                                                                                      \
    cublasStatus_t moe_st_ = (stmt);                                                        \
    if (moe_st_ != CUBLAS_STATUS_SUCCESS)                                                   \
      return ::moe::cuda::cuda_error_at(#stmt, ::moe::cuda::cublas_status_name(moe_st_),    \
                                        __func__, __FILE__, __LINE__);                      \
  } while (0)

// After a kernel launch: reports a bad launch configuration at once.
#define MOE_CUDA_LAUNCHED() MOE_CUDA_TRY(cudaGetLastError())

// Shape validation inside host launchers.
#define MOE_CUDA_REQUIRE(cond, msg)                                                      \
  do {                                                                                   \
    if (!(cond))                                                                         \
      return ::moe::make_error(std::string(__func__) + ": " + (msg) + " (`" #cond "`)"); \
  } while (0)
