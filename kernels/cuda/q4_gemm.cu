// Grouped GEMM in four launches: (1) group the (token, slot) pairs by expert
// and cut each expert's list into BM-row tiles; (2) gate/up GEMM with the
// SiLU product in the epilogue -> h [pairs, inter] bf16; (3) down GEMM scaled
// by the routing weight -> partial [pairs, hidden] f32; (4) sum each token's
// pairs into out. Tiles: BM pairs x 64 output rows x 64 inputs, 4 warps of
// 32 x (64 or 16) on bf16 wmma with f32 accumulators. BM is 64, or 32 when
// the experts get few pairs each (a prompt spread evenly over 128 experts
// gives each ~32 of 4,096: a 64-row tile would be half empty). The next
// k-step's activations and codes are loaded into registers while the
// current one's MMAs run (one shared-memory stage, two barriers a step).
#include <mma.h>

#include <type_traits>

#include "kernels/cuda/cuda_check.cuh"
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/device_math.cuh"
#include "kernels/cuda/q4_gemm.cuh"

namespace moe::cuda {
namespace {

using namespace nvcuda;

constexpr int BN = 64, BK = 64;
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
int max_tiles(int pairs, int n_experts, int bm) { return (pairs + bm - 1) / bm + n_experts; }
// Rows of a tile: 32 while the experts average at most 40 pairs each.
int tile_rows(int pairs, int n_experts) { return pairs <= 40 * n_experts ? 32 : 64; }

Workspace carve(void* base, const ExpertLayout& L, int pairs, int n_experts) {
  Workspace w{};
  size_t off = 0;
  auto take = [&](size_t bytes) {
    void* p = static_cast<uint8_t*>(base) + off;
    off += align_up(bytes);
    return p;
  };
  const int mt = max_tiles(pairs, n_experts, 32);  // the most tiles either height makes
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

__global__ void align_kernel(const int32_t* ids, int pairs, int n_experts, int bm, Workspace w) {
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
      tiles += (counts[e] + bm - 1) / bm;
    }
    w.offsets[n_experts] = off;
    *w.n_tiles = tiles;
  }
  __syncthreads();
  for (int e = threadIdx.x; e < n_experts; e += blockDim.x)
    for (int j = 0; j * bm < counts[e]; ++j) {
      w.tile_expert[tile0[e] + j] = e;
      w.tile_m0[tile0[e] + j] = j * bm;
    }
  for (int p = threadIdx.x; p < pairs; p += blockDim.x) {
    const int e = ids[p];
    if (e >= 0 && e < n_experts) w.sorted[w.offsets[e] + atomicAdd(&cursor[e], 1)] = p;
  }
}

struct GemmParams {
  const uint8_t* const* blobs;
  const float* route_weights;  // [pairs]
  int top_k, n_experts;
  Q4MatrixLayout m0, m1;       // gate, up (GATE_UP) or down
  const __nv_bfloat16* a;      // GATE_UP: x [tokens, hidden]; else h [pairs, inter]
  Workspace w;
};

// One k-step's global data, held in registers: each thread's 16-byte pieces
// of the BM x 64 activations, and one 32-input run of codes of weight row
// threadIdx.x / 2 (inputs (threadIdx.x % 2) * 32 ...) of each matrix with
// its group's scale and bias (zero past the matrix's rows: its weights
// dequantise to zero).
template <int BM, int MATS>
struct Stage {
  static constexpr int kA = BM * (BK / 8) / kThreads;
  uint4 a[kA];
  uint4 codes[MATS];
  float2 sb[MATS];

  __device__ __forceinline__ void load(const GemmParams& p, const int32_t* rows, const uint8_t* blob, int n0,
                                       int k0, int K) {
#pragma unroll
    for (int i = 0; i < kA; ++i) {
      const int idx = threadIdx.x + i * kThreads, r = idx >> 3, c = idx & 7;
      const int pair = rows[r];
      a[i] = make_uint4(0, 0, 0, 0);
      if (pair >= 0) {
        const size_t arow = MATS == 2 ? size_t(pair / p.top_k) : size_t(pair);
        a[i] = *reinterpret_cast<const uint4*>(p.a + arow * K + k0 + c * 8);
      }
    }
    const int n = n0 + (threadIdx.x >> 1), kb = k0 + (threadIdx.x & 1) * 32;
#pragma unroll
    for (int m = 0; m < MATS; ++m) {
      const Q4MatrixLayout& L = m == 0 ? p.m0 : p.m1;
      codes[m] = make_uint4(0, 0, 0, 0);
      sb[m] = make_float2(0.f, 0.f);
      if (n < L.rows) {
        codes[m] = __ldg(reinterpret_cast<const uint4*>(blob + L.codes_offset + size_t(n) * (L.cols / 2) + kb / 2));
        sb[m] = __half22float2(
            reinterpret_cast<const half2*>(blob + L.params_offset)[size_t(n) * (L.cols / L.group) + kb / L.group]);
      }
    }
  }

  // The activations into As [BM][LDS]; each matrix's run dequantised to
  // bf16 into its Bs [BN][LDS] (row threadIdx.x / 2).
  __device__ __forceinline__ void store(__nv_bfloat16* As, __nv_bfloat16* Bs) const {
#pragma unroll
    for (int i = 0; i < kA; ++i) {
      const int idx = threadIdx.x + i * kThreads, r = idx >> 3, c = idx & 7;
      *reinterpret_cast<uint4*>(As + r * LDS + c * 8) = a[i];
    }
    const int r = threadIdx.x >> 1, half = threadIdx.x & 1;
#pragma unroll
    for (int m = 0; m < MATS; ++m) {
      const uint32_t ws[4] = {codes[m].x, codes[m].y, codes[m].z, codes[m].w};
      uint4* d = reinterpret_cast<uint4*>(Bs + m * BN * LDS + r * LDS + half * 32);
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        float f[8];
        detail::q4_word_to_floats(ws[q], f);
        __nv_bfloat162 b[4];
#pragma unroll
        for (int e = 0; e < 4; ++e)
          b[e] = __floats2bfloat162_rn(fmaf(f[2 * e], sb[m].x, sb[m].y), fmaf(f[2 * e + 1], sb[m].x, sb[m].y));
        uint4 u;
        memcpy(&u, b, 16);
        d[q] = u;
      }
    }
  }
};

// grid: (ceil(N / BN), max_tiles). Warps: WM x WN of 32 x BN/WN outputs.
// Blocks an SM: 3 for the 64-row gate/up tile (64 accumulators and the next
// step's loads: ~170 registers uncapped, which would leave 2), else 5.
template <int BM, bool GATE_UP>
__global__ void __launch_bounds__(kThreads, (BM == 64 && GATE_UP) ? 3 : 5) grouped_gemm_kernel(GemmParams p) {
  detail::allow_next_grid();
  detail::wait_prior_grid();
  constexpr int kMats = GATE_UP ? 2 : 1;
  constexpr int WN = BM == 64 ? 2 : 4, FM = 2, FN = BN / WN / 16;
  static_assert(BM / (kThreads / 32 / WN) == 32, "a warp owns 32 rows");
  constexpr size_t kMainBytes = size_t(BM + kMats * BN) * LDS * 2;
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
  __nv_bfloat16* Bs = As + BM * LDS;
  const int warp = threadIdx.x >> 5, wm = warp / WN, wn = warp % WN;
  wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[kMats][FM][FN];
#pragma unroll
  for (int t = 0; t < kMats; ++t)
#pragma unroll
    for (int i = 0; i < FM; ++i)
#pragma unroll
      for (int j = 0; j < FN; ++j) wmma::fill_fragment(acc[t][i][j], 0.f);
  __syncthreads();

  Stage<BM, kMats> stage;
  stage.load(p, rows, blob, n0, 0, K);
  for (int k0 = 0; k0 < K; k0 += BK) {
    stage.store(As, Bs);
    __syncthreads();
    if (k0 + BK < K) stage.load(p, rows, blob, n0, k0 + BK, K);  // in flight during the MMAs
#pragma unroll
    for (int kk = 0; kk < BK; kk += 16) {
      wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::row_major> fa[FM];
#pragma unroll
      for (int i = 0; i < FM; ++i) wmma::load_matrix_sync(fa[i], As + (wm * 32 + i * 16) * LDS + kk, LDS);
#pragma unroll
      for (int t = 0; t < kMats; ++t) {
#pragma unroll
        for (int j = 0; j < FN; ++j) {
          wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, wmma::col_major> fb;
          wmma::load_matrix_sync(fb, Bs + t * BN * LDS + (wn * (BN / WN) + j * 16) * LDS + kk, LDS);
#pragma unroll
          for (int i = 0; i < FM; ++i) wmma::mma_sync(acc[t][i][j], fa[i], fb, acc[t][i][j]);
        }
      }
    }
    __syncthreads();
  }
  float* Cs = reinterpret_cast<float*>(smem);
#pragma unroll
  for (int t = 0; t < kMats; ++t)
#pragma unroll
    for (int i = 0; i < FM; ++i)
#pragma unroll
      for (int j = 0; j < FN; ++j)
        wmma::store_matrix_sync(Cs + t * BM * LDC + (wm * 32 + i * 16) * LDC + wn * (BN / WN) + j * 16,
                                acc[t][i][j], LDC, wmma::mem_row_major);
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
  const int bm = tile_rows(pairs, a.n_experts);
  MOE_CUDA_TRY(detail::launch_pdl(align_kernel, dim3(1), dim3(1024), size_t(3) * a.n_experts * 4, stream, a.expert_ids,
                                  pairs, a.n_experts, bm, w));
  MOE_CUDA_LAUNCHED();
  GemmParams p{};
  p.blobs = a.blobs;
  p.route_weights = a.route_weights;
  p.top_k = a.top_k;
  p.n_experts = a.n_experts;
  p.w = w;
  const int mt = max_tiles(pairs, a.n_experts, bm);
  auto gemm = [&](auto rows, auto gate_up, int n_out) {
    auto kern = grouped_gemm_kernel<decltype(rows)::value, decltype(gate_up)::value>;
    return detail::launch_pdl(kern, dim3((n_out + BN - 1) / BN, mt), dim3(kThreads), 0, stream, p);
  };
  using Rows32 = std::integral_constant<int, 32>;
  using Rows64 = std::integral_constant<int, 64>;
  p.m0 = a.layout.gate;
  p.m1 = a.layout.up;
  p.a = x;
  MOE_CUDA_TRY(bm == 32 ? gemm(Rows32{}, std::true_type{}, a.layout.inter) : gemm(Rows64{}, std::true_type{}, a.layout.inter));
  MOE_CUDA_LAUNCHED();
  p.m0 = a.layout.down;
  p.a = w.h;
  MOE_CUDA_TRY(bm == 32 ? gemm(Rows32{}, std::false_type{}, a.layout.hidden)
                        : gemm(Rows64{}, std::false_type{}, a.layout.hidden));
  MOE_CUDA_LAUNCHED();
  MOE_CUDA_TRY(detail::launch_pdl(combine_kernel, dim3(a.tokens), dim3(256), 0, stream, w.partial, a.expert_ids, a.n_experts, a.top_k, a.layout.hidden, out));
  MOE_CUDA_LAUNCHED();
  return {};
}

}  // namespace moe::cuda
