// Grouped GEMM in four launches: (1) group the (token, slot) pairs by expert
// and cut each expert's list into BM-row tiles; (2) gate/up GEMM with the
// SiLU product in the epilogue -> h [pairs, inter] bf16; (3) down GEMM scaled
// by the routing weight -> partial [pairs, hidden] f32; (4) sum each token's
// pairs into out. Tiles: BM pairs x BN outputs, four warps side by side,
// m16n8k16 bf16 MMAs with f32 accumulators, the INT4 weights dequantised in
// registers (grouped_gemm_kernel below). BM is 64, or 32 when the experts
// get few pairs each (a prompt spread evenly over 128 experts gives each ~32
// of 4,096: a 64-row tile would be half empty).
#include <type_traits>

#include "kernels/cuda/cuda_check.cuh"
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/device_math.cuh"
#include "kernels/cuda/q4_gemm.cuh"

namespace moe::cuda {
namespace {

constexpr int kWarps = 4, kThreads = kWarps * 32;
constexpr int kStages = 4;  // 32-input chunks of K in flight

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

// 16 bytes global -> shared without passing through registers (sm_80+);
// src_bytes 0 fills the 16 with zeros and reads nothing. kBytes 4 (scales)
// goes through L1, 16 straight from L2.
template <int kBytes>
__device__ __forceinline__ void cp_async(void* dst, const void* src, int src_bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const uint32_t d = uint32_t(__cvta_generic_to_shared(dst));
  if constexpr (kBytes == 16)
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(d), "l"(src), "r"(src_bytes));
  else
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2, %3;" ::"r"(d), "l"(src), "n"(kBytes), "r"(src_bytes));
#endif
}
__device__ __forceinline__ void cp_async_commit() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;");
#endif
}
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_group %0;" ::"n"(kPending));
#endif
}

// The tile's shape: BM pairs x BN outputs of each of MATS matrices, four
// warps side by side along the outputs, each over all BM rows and NT
// 8-output n tiles (16 accumulator fragments a warp: 64 registers).
template <int BM, int MATS>
struct TileShape {
  static constexpr int kMTiles = BM / 16;
  static constexpr int kNT = 16 / (kMTiles * MATS);
  static constexpr int kBN = kWarps * kNT * 8;
  static constexpr int kRows = kBN * MATS;  // weight rows a block reads
};

// One 32-input chunk of K, staged: the tile's activations (BM rows of 4
// 16-byte pieces), each weight row's 16 bytes of codes, and each row's
// (scale, bias) for the chunk's group.
template <int BM, int MATS>
struct ChunkStage {
  uint4 a[BM][4];
  uint32_t codes[TileShape<BM, MATS>::kRows][4];
  uint32_t sb[TileShape<BM, MATS>::kRows];
};

// Grouped GEMM on m16n8k16 MMAs, the weights dequantised in registers.
// Inputs walk K in 32-input chunks, kStages chunks in flight (cp.async into
// shared memory, one barrier a chunk). Within a chunk, the MMA's k positions
// are a permutation of the inputs that both operands share: lane (g, c)
// takes inputs 8c..8c+7 of the chunk, its k positions {2c, 2c+1, 2c+8,
// 2c+9} of the first step holding inputs 8c+0..3 and of the second 8c+4..7.
// So one 32-bit code word (8 nibbles) is a lane's B fragments for both steps
// of an n tile, and one 16-byte piece of an activation row its A fragments
// for both steps of that row: no ldmatrix, no dequantised tile in shared
// memory.
template <int BM, bool GATE_UP>
__global__ void __launch_bounds__(kThreads) grouped_gemm_kernel(GemmParams p) {
  detail::allow_next_grid();
  detail::wait_prior_grid();
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  constexpr int kMats = GATE_UP ? 2 : 1;
  using S = TileShape<BM, kMats>;
  constexpr int kMT = S::kMTiles, kNT = S::kNT, kBN = S::kBN, kRows = S::kRows;
  __shared__ __align__(16) ChunkStage<BM, kMats> st[kStages];
  __shared__ int32_t rows[BM];
  const int tile = blockIdx.y;
  if (tile >= *p.w.n_tiles) return;
  const int e = p.w.tile_expert[tile], m0 = p.w.tile_m0[tile];
  const int base = p.w.offsets[e], count = p.w.offsets[e + 1] - base;
  const uint8_t* blob = p.blobs[e];
  const int n0 = blockIdx.x * kBN;
  const int K = p.m0.cols, N = p.m0.rows, chunks = K / 32;
  for (int r = threadIdx.x; r < BM; r += kThreads) rows[r] = m0 + r < count ? p.w.sorted[base + m0 + r] : -1;
  __syncthreads();

  // Chunk j into stage s: activations, codes and (scale, bias); rows past
  // the matrix or the tile read nothing and stage zeros.
  auto load_chunk = [&](int j, int s) {
    ChunkStage<BM, kMats>& cs = st[s];
    for (int i = threadIdx.x; i < BM * 4; i += kThreads) {
      const int r = i >> 2, piece = i & 3, pair = rows[r];
      const size_t arow = pair < 0 ? 0 : GATE_UP ? size_t(pair / p.top_k) : size_t(pair);
      cp_async<16>(&cs.a[r][piece], p.a + arow * K + 32 * j + 8 * piece, pair < 0 ? 0 : 16);
    }
    for (int i = threadIdx.x; i < kRows; i += kThreads) {
      const int m = i / kBN, n = n0 + i % kBN;
      const Q4MatrixLayout& L = m == 0 ? p.m0 : p.m1;
      const bool in = n < L.rows;
      const size_t row = in ? size_t(n) : 0;
      cp_async<16>(&cs.codes[i][0], blob + L.codes_offset + row * (L.cols / 2) + 16 * j, in ? 16 : 0);
      cp_async<4>(&cs.sb[i], blob + L.params_offset + (row * (L.cols / L.group) + 32 * j / L.group) * 4, in ? 4 : 0);
    }
  };

  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, c = lane & 3;
  float acc[kMats][kMT][kNT][4];
#pragma unroll
  for (int m = 0; m < kMats; ++m)
#pragma unroll
    for (int i = 0; i < kMT; ++i)
#pragma unroll
      for (int t = 0; t < kNT; ++t) acc[m][i][t][0] = acc[m][i][t][1] = acc[m][i][t][2] = acc[m][i][t][3] = 0.f;

#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < chunks) load_chunk(s, s);
    cp_async_commit();
  }
  for (int j = 0; j < chunks; ++j) {
    cp_async_wait<kStages - 2>();
    __syncthreads();  // chunk j has landed for every thread; stage (j - 1) is free
    if (j + kStages - 1 < chunks) load_chunk(j + kStages - 1, (j + kStages - 1) % kStages);
    cp_async_commit();
    const ChunkStage<BM, kMats>& cs = st[j % kStages];
    // B fragments: this lane's 8 inputs of row g of each n tile, dequantised.
    uint32_t b[kMats][kNT][4];
#pragma unroll
    for (int m = 0; m < kMats; ++m)
#pragma unroll
      for (int t = 0; t < kNT; ++t) {
        const int r = m * kBN + warp * kNT * 8 + t * 8 + g;
        float f[8];
        detail::q4_word_to_floats(cs.codes[r][c], f);
        const float2 sb = __half22float2(detail::as_half2(cs.sb[r]));
#pragma unroll
        for (int q = 0; q < 4; ++q)
          b[m][t][q] = detail::bf16x2_bits(fmaf(f[2 * q], sb.x, sb.y), fmaf(f[2 * q + 1], sb.x, sb.y));
      }
#pragma unroll
    for (int i = 0; i < kMT; ++i) {
      const uint4 lo = cs.a[i * 16 + g][c], hi = cs.a[i * 16 + g + 8][c];
#pragma unroll
      for (int m = 0; m < kMats; ++m)
#pragma unroll
        for (int t = 0; t < kNT; ++t) {
          detail::mma_bf16_16816(acc[m][i][t], lo.x, hi.x, lo.y, hi.y, b[m][t][0], b[m][t][1]);
          detail::mma_bf16_16816(acc[m][i][t], lo.z, hi.z, lo.w, hi.w, b[m][t][2], b[m][t][3]);
        }
    }
  }
  cp_async_wait<0>();

  // acc[m][i][t][q]: row i * 16 + g + 8 (q / 2), output n0 + warp's + 8 t + 2c + q % 2.
#pragma unroll
  for (int i = 0; i < kMT; ++i)
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int pair = rows[i * 16 + g + 8 * half];
      if (pair < 0) continue;
#pragma unroll
      for (int t = 0; t < kNT; ++t) {
        const int n = n0 + warp * kNT * 8 + t * 8 + 2 * c;
        if (n >= N) continue;  // N is even: n + 1 < N too
        const float v0 = acc[0][i][t][2 * half], v1 = acc[0][i][t][2 * half + 1];
        if constexpr (GATE_UP) {
          const float u0 = acc[kMats - 1][i][t][2 * half], u1 = acc[kMats - 1][i][t][2 * half + 1];
          *reinterpret_cast<uint32_t*>(p.w.h + size_t(pair) * N + n) =
              detail::bf16x2_bits(detail::silu(v0) * u0, detail::silu(v1) * u1);
        } else {
          const float w = p.route_weights[pair];
          *reinterpret_cast<float2*>(p.w.partial + size_t(pair) * N + n) = make_float2(w * v0, w * v1);
        }
      }
    }
#elif defined(__CUDA_ARCH__)
  __trap();  // tensor-core bf16 needs sm_80; builds target 80 and up
#endif
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
  return L.hidden % 64 == 0 && L.inter % 64 == 0 && L.gate.group % 32 == 0 && L.up.group % 32 == 0 &&
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
    constexpr int bn = TileShape<decltype(rows)::value, decltype(gate_up)::value ? 2 : 1>::kBN;
    return detail::launch_pdl(kern, dim3((n_out + bn - 1) / bn, mt), dim3(kThreads), 0, stream, p);
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
