#include "kernels/cuda/cuda_check.cuh"
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/dense_matmul.cuh"
#include "kernels/cuda/device_math.cuh"

namespace moe::cuda {
namespace {

constexpr int kWarps = 8;
constexpr int kRowsPerWarp = 2;
constexpr int kThreads = kWarps * 32;

// x staged in shared memory as bf16 [tokens, k]; each lane takes 16-byte runs
// (8 inputs) of two rows and dots them with every token. The first runs of
// weights are loaded before waiting for the previous kernel (nothing writes
// weights), and each round loads the next runs before using the current.
// Where the kernel's input comes from.
enum class In { bf16, rmsnorm, silu };

struct GemvIn {
  const __nv_bfloat16* x = nullptr;        // In::bf16: [T, k]
  const float* xf = nullptr;               // In::rmsnorm: [T, k]; In::silu: [T, stride]
  const __nv_bfloat16* norm_w = nullptr;   // In::rmsnorm
  float eps = 0.f;
  __nv_bfloat16* xn_out = nullptr;         // In::rmsnorm, optional
  int stride = 0;                          // In::silu
};

template <int T, In MODE>
__device__ void stage_input(const GemvIn& in, int k, uint4* xs) {
  const int kc = k / 8;
  if constexpr (MODE == In::bf16) {
    const uint4* xg = reinterpret_cast<const uint4*>(in.x);
    for (int i = threadIdx.x; i < T * kc; i += kThreads) xs[i] = xg[i];
  } else {
    __shared__ float red[kWarps][T];
    __shared__ float inv[T];
    if constexpr (MODE == In::rmsnorm) {
      float ss[T];
#pragma unroll
      for (int t = 0; t < T; ++t) ss[t] = 0.f;
      for (int i = threadIdx.x; i < k; i += kThreads)
#pragma unroll
        for (int t = 0; t < T; ++t) {
          const float v = in.xf[size_t(t) * k + i];
          ss[t] += v * v;
        }
#pragma unroll
      for (int t = 0; t < T; ++t) {
        const float v = detail::warp_sum(ss[t]);
        if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5][t] = v;
      }
      __syncthreads();
      if (threadIdx.x < T) {
        float sum = 0.f;
        for (int w = 0; w < kWarps; ++w) sum += red[w][threadIdx.x];
        inv[threadIdx.x] = rsqrtf(sum / float(k) + in.eps);
      }
      __syncthreads();
    }
    for (int c = threadIdx.x; c < T * kc; c += kThreads) {
      const int t = c / kc, i0 = (c % kc) * 8;
      float v[8];
      if constexpr (MODE == In::rmsnorm) {
        const float* xr = in.xf + size_t(t) * k + i0;
#pragma unroll
        for (int e = 0; e < 8; ++e) v[e] = __bfloat162float(in.norm_w[i0 + e]) * (xr[e] * inv[t]);
      } else {
        const float* g = in.xf + size_t(t) * in.stride + i0;
#pragma unroll
        for (int e = 0; e < 8; ++e) v[e] = detail::silu(g[e]) * g[k + e];
      }
      uint4 u;
      __nv_bfloat162 b[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) b[e] = __floats2bfloat162_rn(v[2 * e], v[2 * e + 1]);
      memcpy(&u, b, 16);
      xs[c] = u;
      if (MODE == In::rmsnorm && in.xn_out && blockIdx.x == 0) reinterpret_cast<uint4*>(in.xn_out)[c] = u;
    }
  }
}

template <int T, In MODE>
__global__ void __launch_bounds__(kThreads)
    gemv_kernel(const __nv_bfloat16* __restrict__ w, GemvIn in, float* y, int n_out, int k, bool accumulate,
                const float* gate, int gate_stride) {
  extern __shared__ uint4 xs[];  // [T, k/8]
  detail::allow_next_grid();
  const int kc = k / 8;
  const int lane = threadIdx.x & 31;
  const int row0 = (blockIdx.x * kWarps + (threadIdx.x >> 5)) * kRowsPerWarp;
  const uint4* wr[kRowsPerWarp];
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r)
    wr[r] = reinterpret_cast<const uint4*>(w + size_t(min(row0 + r, n_out - 1)) * k);
  const bool active = row0 < n_out;
  uint4 cur[kRowsPerWarp][2];
  auto load = [&](uint4 (&dst)[kRowsPerWarp][2], int c0) {
#pragma unroll
    for (int u = 0; u < 2; ++u)
#pragma unroll
      for (int r = 0; r < kRowsPerWarp; ++r)
        if (active && c0 + 32 * u < kc) dst[r][u] = __ldcs(wr[r] + c0 + 32 * u);
  };
  load(cur, lane);
  detail::wait_prior_grid();
  stage_input<T, MODE>(in, k, xs);
  __syncthreads();
  if (!active) return;
  float acc[kRowsPerWarp][T];
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r)
#pragma unroll
    for (int t = 0; t < T; ++t) acc[r][t] = 0.f;
  for (int c0 = lane; c0 < kc; c0 += 64) {
    uint4 nxt[kRowsPerWarp][2];
    load(nxt, c0 + 64);
#pragma unroll
    for (int u = 0; u < 2; ++u) {
      const int c = c0 + 32 * u;
      if (c >= kc) break;
      float wf[kRowsPerWarp][8];
#pragma unroll
      for (int r = 0; r < kRowsPerWarp; ++r) {
        const __nv_bfloat162* b = reinterpret_cast<const __nv_bfloat162*>(&cur[r][u]);
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const float2 f = __bfloat1622float2(b[e]);
          wf[r][2 * e] = f.x;
          wf[r][2 * e + 1] = f.y;
        }
      }
#pragma unroll
      for (int t = 0; t < T; ++t) {
        const uint4 xv = xs[t * kc + c];
        const __nv_bfloat162* b = reinterpret_cast<const __nv_bfloat162*>(&xv);
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const float2 f = __bfloat1622float2(b[e]);
#pragma unroll
          for (int r = 0; r < kRowsPerWarp; ++r) {
            acc[r][t] = fmaf(wf[r][2 * e], f.x, acc[r][t]);
            acc[r][t] = fmaf(wf[r][2 * e + 1], f.y, acc[r][t]);
          }
        }
      }
    }
#pragma unroll
    for (int u = 0; u < 2; ++u)
#pragma unroll
      for (int r = 0; r < kRowsPerWarp; ++r) cur[r][u] = nxt[r][u];
  }
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r)
#pragma unroll
    for (int t = 0; t < T; ++t) acc[r][t] = detail::warp_sum(acc[r][t]);
  if (lane == 0) {
#pragma unroll
    for (int r = 0; r < kRowsPerWarp; ++r) {
      if (row0 + r >= n_out) break;
#pragma unroll
      for (int t = 0; t < T; ++t) {
        float v = acc[r][t];
        if (gate) v *= detail::sigmoid(gate[size_t(t) * gate_stride]);
        float* o = y + size_t(t) * n_out + row0 + r;
        *o = accumulate ? *o + v : v;
      }
    }
  }
}

template <int T, In MODE>
Status launch_gemv(const __nv_bfloat16* w, const GemvIn& in, float* y, int n_out, int k, bool acc,
                   const float* gate, int gate_stride, cudaStream_t stream) {
  const size_t smem = size_t(T) * k * 2;
  if (smem > 48 * 1024)
    MOE_CUDA_TRY(cudaFuncSetAttribute(gemv_kernel<T, MODE>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                      int(smem)));
  const int rows_per_block = kWarps * kRowsPerWarp;
  MOE_CUDA_TRY(detail::launch_pdl(gemv_kernel<T, MODE>, dim3((n_out + rows_per_block - 1) / rows_per_block),
                                  dim3(kThreads), smem, stream, w, in, y, n_out, k, acc, gate, gate_stride));
  MOE_CUDA_LAUNCHED();
  return {};
}

template <In MODE>
Status gemv_dispatch(const __nv_bfloat16* w, const GemvIn& in, float* y, int tokens, int n_out, int k,
                     bool accumulate, const float* gate_logits, int gate_stride, cudaStream_t stream) {
  MOE_CUDA_REQUIRE(w && y, "null pointer");
  MOE_CUDA_REQUIRE(tokens >= 1 && tokens <= kGemvMaxTokens, "tokens must be in [1, 8]");
  MOE_CUDA_REQUIRE(n_out > 0 && k > 0 && k % 8 == 0, "k must be a positive multiple of 8");
  MOE_CUDA_REQUIRE(size_t(tokens) * k * 2 <= 200 * 1024, "tokens * k too large for shared memory");
  MOE_CUDA_REQUIRE(reinterpret_cast<uintptr_t>(w) % 16 == 0, "w must be 16-byte aligned");
  switch (tokens) {
#define MOE_GEMV_CASE(T) \
  case T: return launch_gemv<T, MODE>(w, in, y, n_out, k, accumulate, gate_logits, gate_stride, stream);
    MOE_GEMV_CASE(1) MOE_GEMV_CASE(2) MOE_GEMV_CASE(3) MOE_GEMV_CASE(4)
    MOE_GEMV_CASE(5) MOE_GEMV_CASE(6) MOE_GEMV_CASE(7) MOE_GEMV_CASE(8)
#undef MOE_GEMV_CASE
  }
  return make_error("dense_gemv: unreachable token count");
}

}  // namespace

Status dense_gemv_bf16(const __nv_bfloat16* w, const __nv_bfloat16* x, float* y, int tokens, int n_out, int k,
                       bool accumulate, const float* gate_logits, int gate_stride, cudaStream_t stream) {
  MOE_CUDA_REQUIRE(x && reinterpret_cast<uintptr_t>(x) % 16 == 0, "x must be non-null and 16-byte aligned");
  GemvIn in;
  in.x = x;
  return gemv_dispatch<In::bf16>(w, in, y, tokens, n_out, k, accumulate, gate_logits, gate_stride, stream);
}

Status dense_gemv_bf16_rmsnorm(const __nv_bfloat16* w, const float* x_f32, const __nv_bfloat16* norm_w, float eps,
                               __nv_bfloat16* xn_out, float* y, int tokens, int n_out, int k, bool accumulate,
                               const float* gate_logits, int gate_stride, cudaStream_t stream) {
  MOE_CUDA_REQUIRE(x_f32 && norm_w, "null pointer");
  MOE_CUDA_REQUIRE(reinterpret_cast<uintptr_t>(xn_out) % 16 == 0, "xn_out must be 16-byte aligned");
  MOE_CUDA_REQUIRE(!(accumulate && y == x_f32), "y must not alias x_f32 when accumulating");
  GemvIn in;
  in.xf = x_f32;
  in.norm_w = norm_w;
  in.eps = eps;
  in.xn_out = xn_out;
  return gemv_dispatch<In::rmsnorm>(w, in, y, tokens, n_out, k, accumulate, gate_logits, gate_stride, stream);
}

Status dense_gemv_bf16_silu(const __nv_bfloat16* w, const float* gate_up, int gate_up_stride, float* y, int tokens,
                            int n_out, int k, bool accumulate, const float* gate_logits, int gate_stride,
                            cudaStream_t stream) {
  MOE_CUDA_REQUIRE(gate_up && gate_up_stride >= 2 * k, "gate_up null or its stride below 2 k");
  GemvIn in;
  in.xf = gate_up;
  in.stride = gate_up_stride;
  return gemv_dispatch<In::silu>(w, in, y, tokens, n_out, k, accumulate, gate_logits, gate_stride, stream);
}

Result<CublasLtMatmul*> CublasLtMatmul::create(size_t workspace_bytes) {
  auto* m = new CublasLtMatmul();
  auto fail = [&](Error e) -> Result<CublasLtMatmul*> {
    delete m;
    return e;
  };
  if (cublasStatus_t s = cublasLtCreate(&m->handle_); s != CUBLAS_STATUS_SUCCESS)
    return fail(make_error(std::string("cublasLtCreate: ") + cublas_status_name(s)));
  if (cudaError_t e = cudaMalloc(&m->workspace_, workspace_bytes); e != cudaSuccess)
    return fail(make_error(std::string("cuBLASLt workspace: ") + cudaGetErrorString(e)));
  m->workspace_bytes_ = workspace_bytes;
  return m;
}

CublasLtMatmul::~CublasLtMatmul() {
  if (workspace_) cudaFree(workspace_);
  if (handle_) cublasLtDestroy(handle_);
}

// Row-major y[m, n] = x[m, k] W[n, k]^T is column-major y^T[n, m] =
// op_T(W: k x n, ld k) * x (k x m, ld k).
Status CublasLtMatmul::matmul(const __nv_bfloat16* x, const __nv_bfloat16* w, void* y, bool y_f32, int m, int n,
                              int k, float beta, cudaStream_t stream) {
  MOE_CUDA_REQUIRE(x && w && y, "null pointer");
  MOE_CUDA_REQUIRE(m > 0 && n > 0 && k > 0, "shape must be positive");
  const cudaDataType_t yt = y_f32 ? CUDA_R_32F : CUDA_R_16BF;
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t la = nullptr, lb = nullptr, lc = nullptr;
  Status st;
  auto body = [&]() -> Status {
    MOE_CUBLAS_TRY(cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    const cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
    MOE_CUBLAS_TRY(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta)));
    MOE_CUBLAS_TRY(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb)));
    MOE_CUBLAS_TRY(cublasLtMatrixLayoutCreate(&la, CUDA_R_16BF, k, n, k));
    MOE_CUBLAS_TRY(cublasLtMatrixLayoutCreate(&lb, CUDA_R_16BF, k, m, k));
    MOE_CUBLAS_TRY(cublasLtMatrixLayoutCreate(&lc, yt, n, m, n));
    const auto key = std::make_tuple(m, n, k, y_f32, beta != 0.f);
    auto it = algos_.find(key);
    if (it == algos_.end()) {
      cublasLtMatmulPreference_t pref = nullptr;
      MOE_CUBLAS_TRY(cublasLtMatmulPreferenceCreate(&pref));
      cublasStatus_t s = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                              &workspace_bytes_, sizeof(workspace_bytes_));
      cublasLtMatmulHeuristicResult_t res{};
      int found = 0;
      if (s == CUBLAS_STATUS_SUCCESS)
        s = cublasLtMatmulAlgoGetHeuristic(handle_, op, la, lb, lc, lc, pref, 1, &res, &found);
      cublasLtMatmulPreferenceDestroy(pref);
      MOE_CUBLAS_TRY(s);
      MOE_CUDA_REQUIRE(found > 0, "cuBLASLt found no algorithm for this shape");
      it = algos_.emplace(key, res.algo).first;
    }
    const float alpha = 1.f;
    MOE_CUBLAS_TRY(cublasLtMatmul(handle_, op, &alpha, w, la, x, lb, &beta, y, lc, y, lc, &it->second,
                                  workspace_, workspace_bytes_, stream));
    return {};
  };
  st = body();
  if (lc) cublasLtMatrixLayoutDestroy(lc);
  if (lb) cublasLtMatrixLayoutDestroy(lb);
  if (la) cublasLtMatrixLayoutDestroy(la);
  if (op) cublasLtMatmulDescDestroy(op);
  return st;
}

}  // namespace moe::cuda
