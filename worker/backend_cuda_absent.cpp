// A moe-worker built without the CUDA toolkit: the cuda backend is refused
// with a message instead of being silently replaced.
#include "worker/backend.h"

namespace moe::worker {

bool cuda_backend_built() { return false; }

std::string cuda_unavailable_reason(int, std::string*) { return "this moe-worker was built without the CUDA toolkit"; }

int cuda_devices() { return 0; }

std::string cuda_model_refusal(const std::string&, const CudaEngineOptions&) { return ""; }

Result<std::unique_ptr<Backend>> make_cuda_backend(const std::string&, const CudaEngineOptions&) {
  return make_error("this moe-worker was built without the CUDA toolkit; rebuild with nvcc installed or use --backend cpu");
}

}  // namespace moe::worker
