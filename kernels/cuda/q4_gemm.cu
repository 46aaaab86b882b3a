// Grouped GEMM in four launches: (1) group the (token, slot) pairs by expert
// and cut each expert's list into 64-row tiles; (2) gate/up GEMM with the
// SiLU product in the epilogue -> h [pairs, inter] bf16; (3) down GEMM scaled
// by the routing weight -> partial [pairs, hidden] f32; (4) sum each token's
// pairs into out. Tiles: 64 pairs x 64 output rows x 64 inputs, 4 warps of
// 32x32 on bf16 wmma with f32 accumulators.
#include <mma.h>

#include "kernels/cuda/cuda_check.cuh"
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/device_math.cuh"
#include "kernels/cuda/q4_gemm.cuh"

namespace moe::cuda {
namespace {

using namespace nvcuda;

constexpr int BM = 64, BN = 64, BK = 64;
constexpr int kThreads = 128;
constexpr int LDS = BK + 8;   // bf16 tile row stride (pad: fewer bank conflicts)
constexpr int LDC = BN + 4;   // f32 epilogue row stride

struct Workspace {
  int32_t* sorted;       // [pairs]: pair indices grouped by expert
  int32_t* offsets;      // [n_experts + 1]
  int32_t* tile_expert;  // [max_tiles]
  int32_t* tile_m0;      // [max_tiles]
  int32_t* n_tiles;      // [1]
  __nv_bfloat16* h;      // [pairs, inter]
  float* partial;        // [pairs, hidden]
  size_t bytes;
};

size_t align_up(size_t v) { return (v + 255) & ~size_t(255); }
int max_tiles(int pairs, int n_experts) { return (pairs + BM - 1) / BM + n_experts; }

Workspace carve(void* base, const ExpertLayout& L, int pairs, int n_experts) {
  Workspace w{};
  size_t off = 0;
  auto take = [&](size_t bytes) {
    void* p = static_cast<uint8_t*>(base) + off;
    off += align_up(bytes);
    return p;
  };
  const int mt = max_tiles(pairs, n_experts);
  w.sorted = static_cast<int32_t*>(take(size_t(pairs) * 4));
  w.offsets = static_cast<int32_t*>(take(size_t(n_experts + 1) * 4));
  w.tile_expert = static_cast<int32_t*>(take(size_t(mt) * 4));
  w.tile_m0 = static_cast<int32_t*>(take(size_t(mt) * 4));
  w.n_tiles = static_cast<int32_t*>(take(4));
  w.h = static_cast<__nv_bfloat16*>(take(size_t(pairs) * L.inter * 2));
  w.partial = static_cast<float*>(take(size_t(pairs) * L.hidden * 4));
  w.bytes = off;
  return w;
}

__global__ void align_kernel(const int32_t* ids, int pairs, int n_experts, Workspace w) {
  detail::allow_next_grid();
  detail::wait_prior_grid();
  extern __shared__ int32_t sh[];
  int32_t* counts = sh;
  int32_t* cursor = sh + n_experts;
  int32_t* tile0 = sh + 2 * n_experts;
  for (int e = threadIdx.x; e < n_experts; e += blockDim.x) counts[e] = cursor[e] = 0;
  __syncthreads();
  for (int p = threadIdx.x; p < pairs; p += blockDim.x) {
    const int e = ids[p];
    if (e >= 0 && e < n_experts) atomicAdd(&counts[e], 1);
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    int off = 0, tiles = 0;
    for (int e = 0; e < n_experts; ++e) {
      w.offsets[e] = off;
      tile0[e] = tiles;
      off += counts[e];
      tiles += (counts[e] + BM - 1) / BM;
    }
    w.offsets[n_experts] = off;
    *w.n_tiles = tiles;
  }
  __syncthreads();
  for (int e = threadIdx.x; e < n_experts; e += blockDim.x)
    for (int j = 0; j * BM < counts[e]; ++j) {
      w.tile_expert[tile0[e] + j] = e;
      w.tile_m0[tile0[e] + j] = j * BM;
    }
  for (int p = threadIdx.x; p < pairs; p += blockDim.x) {
    const int e = ids[p];
    if (e >= 0 && e < n_experts) w.sorted[w.offsets[e] + atomicAdd(&cursor[e], 1)] = p;
  }
}

// Dequantises rows n0..n0+63, inputs k0..k0+63 of matrix m into dst[64][LDS]
// (rows past `rows` become zeros). Thread t: row t/2, 32 inputs.
__device__ void dequant_tile(const uint8_t* blob, const Q4MatrixLayout& m, int n0, int k0,
                             __nv_bfloat16* dst) {
  const int r = threadIdx.x >> 1, half = threadIdx.x & 1;
  const int n = n0 + r;
  uint4 out[4];
  if (n < m.rows) {
    const int kb = k0 + half * 32;
    const uint4 c = __ldg(reinterpret_cast<const uint4*>(blob + m.codes_offset + size_t(n) * (m.cols / 2) + kb / 2));
    const float2 sb = __half22float2(
        reinterpret_cast<const half2*>(blob + m.params_offset)[size_t(n) * (m.cols / m.group) + kb / m.group]);
    const uint32_t ws[4] = {c.x, c.y, c.z, c.w};
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      uint32_t o[4];
#pragma unroll
      for (int b = 0; b < 4; ++b) {
        const uint32_t byte = (ws[q] >> (8 * b)) & 255u;
        const __nv_bfloat162 v = __floats2bfloat162_rn(fmaf(float(byte & 15u), sb.x, sb.y),
                                                       fmaf(float(byte >> 4), sb.x, sb.y));
        memcpy(&o[b], &v, 4);
      }
      out[q] = make_uint4(o[0], o[1], o[2], o[3]);
    }
  } else {
#pragma unroll
    for (int q = 0; q < 4; ++q) out[q] = make_uint4(0, 0, 0, 0);
  }
  uint4* d = reinterpret_cast<uint4*>(dst + r * LDS + half * 32);
#pragma unroll
  for (int q = 0; q < 4; ++q) d[q] = out[q];
}

struct GemmParams {
  const uint8_t* const* blobs;
  const float* route_weights;  // [pairs]
  int top_k, n_experts;
  Q4MatrixLayout m0, m1;       // gate, up (GATE_UP) or down
  const __nv_bfloat16* a;      // GATE_UP: x [tokens, hidden]; else h [pairs, inter]
  Workspace w;
};

// grid: (ceil(N / BN), max_tiles)
template <bool GATE_UP>
__global__ void __launch_bounds__(kThreads) grouped_gemm_kernel(GemmParams p) {
  detail::allow_next_grid();
  detail::wait_prior_grid();
  constexpr int kMats = GATE_UP ? 2 : 1;
  constexpr size_t kTileBytes = size_t(BM) * LDS * 2;
  constexpr size_t kMainBytes = kTileBytes * (1 + kMats);
  constexpr size_t kEpiBytes = size_t(BM) * LDC * 4 * kMats;
  __shared__ __align__(128) uint8_t smem[kMainBytes > kEpiBytes ? kMainBytes : kEpiBytes];
  __shared__ int32_t rows[BM];
  const int tile = blockIdx.y;
  if (tile >= *p.w.n_tiles) return;
  const int e = p.w.tile_expert[tile], m0 = p.w.tile_m0[tile];
  const int base = p.w.offsets[e], count = p.w.offsets[e + 1] - base;
  const uint8_t* blob = p.blobs[e];
  const int n0 = blockIdx.x * BN;
  const int K = p.m0.cols, N = p.m0.rows;
  for (int r = threadIdx.x; r < BM; r += kThreads)
    rows[r] = m0 + r < count ? p.w.sorted[base + m0 + r] : -1;
  __nv_bfloat16* As = reinterpret_cast<__nv_bfloat16*>(smem);
  __nv_bfloat16* Bs0 = As + BM * LDS;
  __nv_bfloat16* Bs1 = Bs0 + BN * LDS;
  const int warp = threadIdx.x >> 5, wm = warp >> 1, wn = warp & 1;
  wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[kMats][2][2];
#pragma unroll
  for (int t = 0; t < kMats; ++t)
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
      for (int j = 0; j < 2; ++j) wmma::fill_fragment(acc[t][i][j], 0.f);
  __syncthreads();

  for (int k0 = 0; k0 < K; k0 += BK) {
    // A: 64 rows x 64 inputs = 512 16-byte pieces, 4 per thread.
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int idx = threadIdx.x + i * kThreads, r = idx >> 3, c = idx & 7;
      const int pair = rows[r];
      uint4 v = make_uint4(0, 0, 0, 0);
      if (pair >= 0) {
        const size_t arow = GATE_UP ? size_t(pair / p.top_k) : size_t(pair);
        v = *reinterpret_cast<const uint4*>(p.a + arow * K + k0 + c * 8);
      }
      *reinterpret_cast<uint4*>(As + r * LDS + c * 8) = v;
    }
    dequant_tile(blob, p.m0, n0, k0, Bs0);
    if constexpr (GATE_UP) dequant_tile(blob, p.m1, n0, k0, Bs1);
    __syncthreads();
#pragma unroll
    for (int kk = 0; kk < BK; kk += 16) {
      wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::row_major> fa[2];
#pragma unroll
      for (int i = 0; i < 2; ++i) wmma::load_matrix_sync(fa[i], As + (wm * 32 + i * 16) * LDS + kk, LDS);
#pragma unroll
      for (int t = 0; t < kMats; ++t) {
        const __nv_bfloat16* Bs = t == 0 ? Bs0 : Bs1;
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, wmma::col_major> fb;
          wmma::load_matrix_sync(fb, Bs + (wn * 32 + j * 16) * LDS + kk, LDS);
#pragma unroll
          for (int i = 0; i < 2; ++i) wmma::mma_sync(acc[t][i][j], fa[i], fb, acc[t][i][j]);
        }
      }
    }
    __syncthreads();
  }
  float* Cs = reinterpret_cast<float*>(smem);
#pragma unroll
  for (int t = 0; t < kMats; ++t)
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
      for (int j = 0; j < 2; ++j)
        wmma::store_matrix_sync(Cs + t * BM * LDC + (wm * 32 + i * 16) * LDC + wn * 32 + j * 16, acc[t][i][j],
                                LDC, wmma::mem_row_major);
  __syncthreads();
  for (int idx = threadIdx.x; idx < BM * BN; idx += kThreads) {
    const int r = idx / BN, c = idx % BN;
    const int pair = rows[r], n = n0 + c;
    if (pair < 0 || n >= N) continue;
    if constexpr (GATE_UP) {
      const float g = Cs[r * LDC + c], u = Cs[BM * LDC + r * LDC + c];
      p.w.h[size_t(pair) * N + n] = __float2bfloat16(detail::silu(g) * u);
    } else {
      p.w.partial[size_t(pair) * N + n] = p.route_weights[pair] * Cs[r * LDC + c];
    }
  }
}

__global__ void combine_kernel(const float* partial, const int32_t* ids, int n_experts, int top_k, int hidden,
                               float* out) {
  detail::allow_next_grid();
  detail::wait_prior_grid();
  const int t = blockIdx.x;
  for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
    float s = 0.f;
    for (int k = 0; k < top_k; ++k) {
      const int p = t * top_k + k, e = ids[p];
      if (e >= 0 && e < n_experts) s += partial[size_t(p) * hidden + i];
    }
    out[size_t(t) * hidden + i] += s;
  }
}

}  // namespace

bool q4_grouped_supported(const ExpertLayout& L) {
  return L.hidden % BK == 0 && L.inter % BK == 0 && L.gate.group % 32 == 0 && L.up.group % 32 == 0 &&
         L.down.group % 32 == 0;
}

size_t q4_grouped_workspace_bytes(const ExpertLayout& layout, int tokens, int top_k, int n_experts) {
  return carve(nullptr, layout, tokens * top_k, n_experts).bytes;
}

Status q4_grouped_moe(const Q4ExpertArgs& a, const __nv_bfloat16* x, float* out, void* workspace,
                      size_t workspace_bytes, cudaStream_t stream) {
  MOE_CUDA_REQUIRE(a.blobs && a.expert_ids && a.route_weights && x && out && workspace, "null pointer");
  MOE_CUDA_REQUIRE(a.tokens > 0 && a.top_k > 0 && a.n_experts > 0 && a.n_experts <= 4096, "bad counts");
  MOE_CUDA_REQUIRE(q4_grouped_supported(a.layout), "layout not supported by the grouped kernels");
  const int pairs = a.tokens * a.top_k;
  const Workspace w = carve(workspace, a.layout, pairs, a.n_experts);
  MOE_CUDA_REQUIRE(workspace_bytes >= w.bytes, "workspace too small");
  MOE_CUDA_TRY(detail::launch_pdl(align_kernel, dim3(1), dim3(1024), size_t(3) * a.n_experts * 4, stream, a.expert_ids, pairs, a.n_experts, w));
  MOE_CUDA_LAUNCHED();
  GemmParams p{};
  p.blobs = a.blobs;
  p.route_weights = a.route_weights;
  p.top_k = a.top_k;
  p.n_experts = a.n_experts;
  p.w = w;
  const int mt = max_tiles(pairs, a.n_experts);
  p.m0 = a.layout.gate;
  p.m1 = a.layout.up;
  p.a = x;
  MOE_CUDA_TRY(detail::launch_pdl(grouped_gemm_kernel<true>, dim3((a.layout.inter + BN - 1) / BN, mt), dim3(kThreads), 0, stream, p));
  MOE_CUDA_LAUNCHED();
  p.m0 = a.layout.down;
  p.a = w.h;
  MOE_CUDA_TRY(detail::launch_pdl(grouped_gemm_kernel<false>, dim3((a.layout.hidden + BN - 1) / BN, mt), dim3(kThreads), 0, stream, p));
  MOE_CUDA_LAUNCHED();
  MOE_CUDA_TRY(detail::launch_pdl(combine_kernel, dim3(a.tokens), dim3(256), 0, stream, w.partial, a.expert_ids, a.n_experts, a.top_k, a.layout.hidden, out));
  MOE_CUDA_LAUNCHED();
  return {};
}

}  // namespace moe::cuda
