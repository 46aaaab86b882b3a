// moe-bench-dense: the dense decode GEMVs (kernels/cuda/dense_matmul.cuh) in
// each weight dtype at the Qwen3-30B-A3B shapes: q|k|v, o, the router and
// lm_head, 1 and 8 tokens, plain and RMSNorm-fused input. Random weights;
// each case is 200 launches captured in one CUDA graph, replayed 5 times,
// the best replay kept. Prints µs per launch and the weights' bytes per µs.
//   moe-bench-dense
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "kernels/cuda/dense_matmul.cuh"
#include "model/int4.h"

namespace {

#define CHECK_CUDA(x)                                                                        \
  do {                                                                                       \
    cudaError_t e_ = (x);                                                                    \
    if (e_ != cudaSuccess) {                                                                 \
      std::fprintf(stderr, "moe-bench-dense: %s: %s\n", #x, cudaGetErrorString(e_));         \
      std::exit(1);                                                                          \
    }                                                                                        \
  } while (0)

template <typename T>
T* upload(const std::vector<T>& h) {
  T* d = nullptr;
  CHECK_CUDA(cudaMalloc(&d, h.size() * sizeof(T)));
  CHECK_CUDA(cudaMemcpy(d, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice));
  return d;
}

struct Shape {
  const char* name;
  int rows, cols;
};

}  // namespace

int main() {
  using bf16 = __nv_bfloat16;
  const Shape shapes[] = {{"qkv", 5120, 2048}, {"o", 2048, 4096}, {"router", 128, 2048}, {"lm_head", 151936, 2048}};
  std::mt19937 rng(1);
  std::normal_distribution<float> nd(0.f, 0.02f);
  cudaStream_t st;
  CHECK_CUDA(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  cudaDeviceProp prop{};
  CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
  std::printf("moe-bench-dense on %s\n| matrix | dtype | tokens | input | us/launch | weight GB/s |\n|---|---|---|---|---|---|\n",
              prop.name);
  for (const Shape& s : shapes) {
    const size_t n = size_t(s.rows) * s.cols;
    std::vector<float> w(n);
    for (float& v : w) v = nd(rng);
    std::vector<bf16> wb(n);
    for (size_t i = 0; i < n; ++i) wb[i] = __float2bfloat16(w[i]);
    bf16* dwb = upload(wb);
    int8_t* dq = nullptr;
    float* ds = nullptr;
    CHECK_CUDA(cudaMalloc(&dq, n));
    CHECK_CUDA(cudaMalloc(&ds, size_t(s.rows) * 4));
    if (!moe::cuda::quantize_rows_i8(dwb, s.rows, s.cols, dq, ds, st).ok()) return 1;
    const moe::Q4MatrixLayout m = moe::q4_matrix_layout(s.rows, s.cols, 64);
    std::vector<uint8_t> blob(moe::q4_matrix_bytes(m));
    moe::q4_quantize_matrix(w.data(), m, blob.data());
    uint8_t* d4 = upload(blob);
    std::vector<float> xf(size_t(8) * s.cols);
    for (float& v : xf) v = nd(rng) * 50.f;
    std::vector<bf16> xb(xf.size());
    for (size_t i = 0; i < xf.size(); ++i) xb[i] = __float2bfloat16(xf[i]);
    std::vector<bf16> nw(size_t(s.cols), __float2bfloat16(1.f));
    bf16* dx = upload(xb);
    float* dxf = upload(xf);
    bf16* dnw = upload(nw);
    float* dy = nullptr;
    CHECK_CUDA(cudaMalloc(&dy, size_t(8) * s.rows * 4));
    for (const char* dtype : {"bf16", "int8", "int4"}) {
      const std::string dt = dtype;
      const double bytes = dt == "bf16" ? 2.0 * n : dt == "int8" ? n + 4.0 * s.rows : double(blob.size());
      for (int tokens : {1, 8})
        for (bool norm : {false, true}) {
          auto launch = [&]() -> moe::Status {
            if (dt == "bf16")
              return norm ? moe::cuda::dense_gemv_bf16_rmsnorm(dwb, dxf, dnw, 1e-6f, nullptr, dy, tokens, s.rows,
                                                              s.cols, false, nullptr, 0, st)
                          : moe::cuda::dense_gemv_bf16(dwb, dx, dy, tokens, s.rows, s.cols, false, nullptr, 0, st);
            if (dt == "int8")
              return norm ? moe::cuda::dense_gemv_i8_rmsnorm(dq, ds, dxf, dnw, 1e-6f, nullptr, dy, tokens, s.rows,
                                                            s.cols, false, nullptr, 0, st)
                          : moe::cuda::dense_gemv_i8(dq, ds, dx, dy, tokens, s.rows, s.cols, false, nullptr, 0, st);
            return norm ? moe::cuda::dense_gemv_q4_rmsnorm(d4, m, dxf, dnw, 1e-6f, nullptr, dy, tokens, false,
                                                          nullptr, 0, st)
                        : moe::cuda::dense_gemv_q4(d4, m, dx, dy, tokens, false, nullptr, 0, st);
          };
          if (!launch().ok()) return 1;  // sets the shared-memory attribute outside the capture
          CHECK_CUDA(cudaStreamSynchronize(st));
          constexpr int kLaunches = 200;
          cudaGraph_t g;
          cudaGraphExec_t ge;
          CHECK_CUDA(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
          for (int i = 0; i < kLaunches; ++i)
            if (!launch().ok()) return 1;
          CHECK_CUDA(cudaStreamEndCapture(st, &g));
          CHECK_CUDA(cudaGraphInstantiate(&ge, g, 0));
          cudaEvent_t a, b;
          CHECK_CUDA(cudaEventCreate(&a));
          CHECK_CUDA(cudaEventCreate(&b));
          float best = 1e30f;
          for (int rep = 0; rep < 5; ++rep) {
            CHECK_CUDA(cudaEventRecord(a, st));
            CHECK_CUDA(cudaGraphLaunch(ge, st));
            CHECK_CUDA(cudaEventRecord(b, st));
            CHECK_CUDA(cudaEventSynchronize(b));
            float ms = 0;
            CHECK_CUDA(cudaEventElapsedTime(&ms, a, b));
            best = std::min(best, ms);
          }
          const double us = best * 1000.0 / kLaunches;
          std::printf("| %s %dx%d | %s | %d | %s | %.2f | %.0f |\n", s.name, s.rows, s.cols, dtype, tokens,
                      norm ? "rmsnorm" : "bf16", us, bytes / us / 1000.0);
          CHECK_CUDA(cudaGraphExecDestroy(ge));
          CHECK_CUDA(cudaGraphDestroy(g));
          CHECK_CUDA(cudaEventDestroy(a));
          CHECK_CUDA(cudaEventDestroy(b));
        }
    }
    for (void* p : {(void*)dwb, (void*)dq, (void*)ds, (void*)d4, (void*)dx, (void*)dxf, (void*)dnw, (void*)dy})
      CHECK_CUDA(cudaFree(p));
  }
  return 0;
}
