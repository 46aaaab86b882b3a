// INT4 decode GEMVs. One warp computes one output row: each lane streams
// 16-byte runs of the row's codes (32 inputs) and dots them with activations
// staged once per block in shared memory. The fast path keeps the inner
// product in half2 (nibbles become halves with one OR, activations are
// pre-scaled per 32-input chunk so |x| <= 1 and a chunk's partial sum stays
// <= 240), then applies scale and bias in f32:
//   sum_i (q_i s + b) x_i = s * m_c * sum_i q_i (x_i / m_c) + b * sum_i x_i.
#include <cuda_fp16.h>

#include <cstring>
#include <string>
#include <type_traits>

#include "kernels/cuda/cuda_check.cuh"
#include "kernels/cuda/device_math.cuh"
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/q4_dot.cuh"
#include "kernels/cuda/q4_gemv.cuh"

namespace moe::cuda {
namespace {

constexpr int kWarps = 8;  // warps per block, one output row each
constexpr int kThreads = kWarps * 32;
using detail::chunk_dot;
using detail::FastRow;
using detail::kMaxFastChunks;
using detail::stage_fast;
using detail::stage_fast_from;
using detail::staged_bytes;
using detail::to_f;
using detail::warp_sum;

template <typename XT>
__device__ void stage_generic(const XT* __restrict__ x, int K, float* xf) {
  for (int i = threadIdx.x; i < K; i += blockDim.x) xf[i] = to_f(x[i]);
}

// Any even K and group: byte by byte (odd shapes, small models).
__device__ float generic_row_dot(const uint8_t* blob, const Q4MatrixLayout& m, int row,
                                 const float* xf, int lane) {
  const uint8_t* codes = blob + m.codes_offset + size_t(row) * (m.cols / 2);
  const half2* params =
      reinterpret_cast<const half2*>(blob + m.params_offset) + size_t(row) * (m.cols / m.group);
  float acc = 0.f;
  for (int j = lane; j < m.cols / 2; j += 32) {
    const uint8_t b = codes[j];
    const float2 f = __half22float2(params[(2 * j) / m.group]);
    acc += (f.x * float(b & 15) + f.y) * xf[2 * j] + (f.x * float(b >> 4) + f.y) * xf[2 * j + 1];
  }
  return acc;
}

struct RowsParams {
  const uint8_t* blob;           // one matrix (plain GEMV) ...
  const uint8_t* const* blobs;   // ... or the layer's experts, indexed by expert_ids
  const int32_t* expert_ids;     // [pairs]
  int n_experts;
  int top_k;                     // pairs per token (1 for the plain GEMV)
  Q4MatrixLayout m0, m1;         // plain: m0; gate/up: m0 = gate, m1 = up
  const void* x;                 // [tokens, K]
  float* y;                      // [pairs, rows]
  int group_shift;               // log2(group / 32), fast path only
  const int32_t* split;          // [pairs] first row computed (rows below: 0), or null
  int pairs;                     // experts: tokens * top_k
  bool pair_fastest;             // grid (pairs, row blocks) rather than (row blocks, pairs)
  bool group;                    // gate/up: a pair's block serves every pair of its expert ...
  const uint8_t* resident;       // ... unless resident[e] (read from device memory), or null
};

__device__ __forceinline__ float silu(float v) { return v / (1.f + __expf(-v)); }

// This block's pair (or token) and row block on a pairs_grid (below).
__device__ __forceinline__ int2 grid_place(bool pair_fastest) {
  return pair_fastest ? make_int2(blockIdx.x, blockIdx.y) : make_int2(blockIdx.y, blockIdx.x);
}

// grid: (ceil(rows / (kWarps * R)), pairs). GATE_UP: y = silu(m0 x) * (m1 x);
// else y = m0 x. A warp owns R consecutive rows; their weights are loaded
// before the activations are staged, so the two latencies overlap.
template <typename XT, int CPL, bool FAST, bool GATE_UP, int R>
__global__ void __launch_bounds__(kThreads) q4_rows_kernel(RowsParams p) {
  extern __shared__ uint4 smem[];
  const int2 place = grid_place(p.pair_fastest);
  const int pair = place.x, row_block = place.y;
  const uint8_t* blob = p.blob;
  int lo = 0;  // rows below are the host's: zeros here, their weights unread
  if (p.blobs) {
    detail::wait_prior_grid();  // the expert ids come from the router
    // Only now may the down projection start: it reads the same ids (and
    // loads its weights) before its own wait, so the router must be done.
    detail::allow_next_grid();
    const int e = p.expert_ids[pair];
    if (e < 0 || e >= p.n_experts) return;  // uniform per block
    blob = p.blobs[e];
    if (p.split) lo = p.split[pair];
  } else {
    detail::allow_next_grid();
  }
  const int K = p.m0.cols;
  const int nchunks = K / 32;
  const int lane = threadIdx.x & 31;
  const int row0 = (row_block * kWarps + (threadIdx.x >> 5)) * R;
  const int rows = p.m0.rows;
  const XT* x = static_cast<const XT*>(p.x) + size_t(pair / p.top_k) * K;
  uint4* xs = smem;
  float2* stats = reinterpret_cast<float2*>(smem + 4 * nchunks);
  float* xf = reinterpret_cast<float*>(smem);
  if constexpr (FAST) {
    FastRow<CPL> r0[R], r1[R];
#pragma unroll
    for (int r = 0; r < R; ++r) {
      if (row0 + r < rows && row0 + r >= lo) {
        r0[r].load(blob, p.m0, row0 + r, nchunks, p.group_shift, lane);
        if constexpr (GATE_UP) r1[r].load(blob, p.m1, row0 + r, nchunks, p.group_shift, lane);
      }
    }
    detail::wait_prior_grid();  // x comes from the previous kernel; the weights did not
    stage_fast<CPL>(x, nchunks, 1, reinterpret_cast<uint8_t*>(smem), 0);  // K <= CPL * 1024: CPL rounds
    __syncthreads();
#pragma unroll
    for (int r = 0; r < R; ++r) {
      if (row0 + r >= rows) break;
      if (row0 + r < lo) {
        if (lane == 0) p.y[size_t(pair) * rows + row0 + r] = 0.f;
        continue;
      }
      float a = warp_sum(r0[r].dot(xs, stats, nchunks, lane));
      float b = 0.f;
      if constexpr (GATE_UP) b = warp_sum(r1[r].dot(xs, stats, nchunks, lane));
      if (lane == 0) p.y[size_t(pair) * rows + row0 + r] = GATE_UP ? silu(a) * b : a;
    }
  } else {
    detail::wait_prior_grid();
    stage_generic(x, K, xf);
    __syncthreads();
    for (int r = 0; r < R; ++r) {
      if (row0 + r >= rows) break;
      if (row0 + r < lo) {
        if (lane == 0) p.y[size_t(pair) * rows + row0 + r] = 0.f;
        continue;
      }
      float a = warp_sum(generic_row_dot(blob, p.m0, row0 + r, xf, lane));
      float b = 0.f;
      if constexpr (GATE_UP) b = warp_sum(generic_row_dot(blob, p.m1, row0 + r, xf, lane));
      if (lane == 0) p.y[size_t(pair) * rows + row0 + r] = GATE_UP ? silu(a) * b : a;
    }
  }
}

// Members a grouped gate/up block serves (and stages) at most.
constexpr int kGroupVectors = 8;

__device__ __forceinline__ int nth_set_bit(uint64_t m, int k) {
  for (int i = 0; i < k; ++i) m &= m - 1;
  return __ffsll(static_cast<long long>(m)) - 1;
}

// gate/up for passes of several tokens, each expert's rows read once: the
// pairs routed to one expert are its members, in pair order; the block of
// member 0 serves members 0-7 (8-15 are member 8's, and so on; more than 8
// happen only when a token names an expert twice), and the other members'
// blocks return at once. A block's rows' weights are loaded once and dotted
// with each of its members' staged inputs: an expert two tokens share costs
// one read of its weights, from device memory or over the link, not two.
// grid: as q4_rows_kernel's, fast layout only.
template <typename XT, int CPL, int R>
__global__ void __launch_bounds__(kThreads) q4_gate_up_grouped_kernel(RowsParams p) {
  extern __shared__ uint4 smem[];
  const int2 place = grid_place(p.pair_fastest);
  const int pair = place.x, row_block = place.y;
  const int lane = threadIdx.x & 31;
  detail::wait_prior_grid();  // the expert ids come from the router
  detail::allow_next_grid();  // as q4_rows_kernel: the down projection reads the ids early
  const int e = p.expert_ids[pair];
  if (e < 0 || e >= p.n_experts) return;  // uniform per block
  uint64_t members = uint64_t(1) << pair;  // pairs (at most 64) routed to e; every warp finds the same set
  if (!p.resident || !p.resident[e]) {
    members = 0;
    for (int q0 = 0; q0 < p.pairs; q0 += 32) {
      const int q = q0 + lane;
      const bool same = q < p.pairs && p.expert_ids[q] == e;
      members |= uint64_t(__ballot_sync(0xffffffffu, same)) << q0;
    }
  }
  const int rank = __popcll(static_cast<long long>(members & ((uint64_t(1) << pair) - 1)));
  if (rank % kGroupVectors != 0) return;  // an earlier member's block serves this pair
  for (int i = 0; i < rank; ++i) members &= members - 1;  // this block's members come first
  const int nv = min(kGroupVectors, __popcll(static_cast<long long>(members)));
  const int rows = p.m0.rows;
  int lo = 0;  // rows below every member's split are the host's: not read
  if (p.split) {
    lo = rows;
    for (int k = 0; k < nv; ++k) lo = min(lo, p.split[nth_set_bit(members, k)]);
  }
  const uint8_t* blob = p.blobs[e];
  const int K = p.m0.cols;
  const int nchunks = K / 32;
  const size_t per = staged_bytes(K, true);
  const int row0 = (row_block * kWarps + (threadIdx.x >> 5)) * R;
  FastRow<CPL> r0[R], r1[R];
#pragma unroll
  for (int r = 0; r < R; ++r) {
    if (row0 + r < rows && row0 + r >= lo) {
      r0[r].load(blob, p.m0, row0 + r, nchunks, p.group_shift, lane);
      r1[r].load(blob, p.m1, row0 + r, nchunks, p.group_shift, lane);
    }
  }
  detail::wait_prior_grid();  // x comes from the previous kernel
  const XT* x = static_cast<const XT*>(p.x);
  uint8_t* sb = reinterpret_cast<uint8_t*>(smem);
  stage_fast_from<CPL, XT>(
      x, [&](int k) { return x + size_t(nth_set_bit(members, k) / p.top_k) * K; }, nchunks, nv, sb, per);
  __syncthreads();
#pragma unroll 1
  for (int k = 0; k < nv; ++k) {
    const int m = nth_set_bit(members, k);
    const int m_lo = p.split ? p.split[m] : 0;
    const uint4* xs = reinterpret_cast<const uint4*>(sb + k * per);
    const float2* st = reinterpret_cast<const float2*>(sb + k * per + size_t(nchunks) * 64);
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const int row = row0 + r;
      if (row >= rows) break;
      r0[r].opaque();
      r1[r].opaque();
      float v = 0.f;
      if (row >= m_lo) {
        const float a = warp_sum(r0[r].dot(xs, st, nchunks, lane));
        const float u = warp_sum(r1[r].dot(xs, st, nchunks, lane));
        v = silu(a) * u;
      }
      if (lane == 0) p.y[size_t(m) * rows + row] = v;
    }
  }
}

struct DownParams {
  const uint8_t* const* blobs;
  const int32_t* expert_ids;  // [tokens, top_k]
  const float* weights;       // [tokens, top_k]
  int n_experts, top_k;
  Q4MatrixLayout m;           // down [hidden, inter]
  const float* h;             // [tokens * top_k, inter]
  float* out;                 // [tokens, hidden]
  bool accumulate;
  int group_shift;
  const int32_t* split;       // [tokens, top_k] first input of the pair computed here, or null
  bool token_fastest;         // grid (tokens, row blocks) rather than (row blocks, tokens)
};

// Experts whose rows a warp loads together: 8 when a warp owns one row of
// one 16-byte run per lane (K <= 1024), else 4 (at most ~80 registers of
// weights in flight).
template <int CPL, int R>
constexpr int down_group() { return CPL == 1 && R == 1 ? 8 : 4; }

// grid: (ceil(hidden / (kWarps * R)), tokens). Stages the token's top_k
// vectors h; the first group of experts' rows is loaded before staging.
template <int CPL, bool FAST, int R>
__global__ void __launch_bounds__(kThreads) q4_down_kernel(DownParams p) {
  detail::allow_next_grid();
  // The ids and route weights are the router's, done before gate/up let this
  // kernel start: the first experts' weights load before the wait, h after.
  extern __shared__ uint4 smem[];
  const int2 place = grid_place(p.token_fastest);
  const int t = place.x, row_block = place.y;
  const int K = p.m.cols;
  const int nchunks = K / 32;
  const size_t per = staged_bytes(K, FAST);  // a multiple of 16 bytes
  const int lane = threadIdx.x & 31;
  const int row0 = (row_block * kWarps + (threadIdx.x >> 5)) * R;
  const int rows = p.m.rows;
  const int32_t* ids = p.expert_ids + size_t(t) * p.top_k;
  const float* wts = p.weights + size_t(t) * p.top_k;
  auto stage_all = [&]() {
    detail::wait_prior_grid();  // h comes from gate/up
    if constexpr (FAST) {
      stage_fast<4>(p.h + size_t(t) * p.top_k * K, nchunks, p.top_k, reinterpret_cast<uint8_t*>(smem), per);
    } else {
      for (int k = 0; k < p.top_k; ++k)
        stage_generic(p.h + (size_t(t) * p.top_k + k) * K, K,
                      reinterpret_cast<float*>(reinterpret_cast<uint8_t*>(smem) + k * per));
    }
    __syncthreads();
  };
  float acc[R];
#pragma unroll
  for (int r = 0; r < R; ++r) acc[r] = 0.f;
  if constexpr (FAST) {
    constexpr int kDownGroup = down_group<CPL, R>();
    for (int k0 = 0; k0 < p.top_k; k0 += kDownGroup) {
      FastRow<CPL> fr[kDownGroup][R];
      bool ok[kDownGroup];
#pragma unroll
      for (int j = 0; j < kDownGroup; ++j) {
        const int k = k0 + j;
        const int e = k < p.top_k ? ids[k] : -1;
        ok[j] = e >= 0 && e < p.n_experts;
        if (ok[j]) {
          const uint8_t* blob = p.blobs[e];
#pragma unroll
          for (int r = 0; r < R; ++r)
            if (row0 + r < rows) fr[j][r].load(blob, p.m, row0 + r, nchunks, p.group_shift, lane);
        }
      }
      if (k0 == 0) stage_all();
#pragma unroll
      for (int j = 0; j < kDownGroup; ++j) {
        if (!ok[j]) continue;
        const uint8_t* base = reinterpret_cast<const uint8_t*>(smem) + (k0 + j) * per;
        const uint4* xs = reinterpret_cast<const uint4*>(base);
        const float2* st = reinterpret_cast<const float2*>(base + size_t(nchunks) * 64);
#pragma unroll
        for (int r = 0; r < R; ++r)
          if (row0 + r < rows) acc[r] += wts[k0 + j] * fr[j][r].dot(xs, st, nchunks, lane);
      }
    }
  } else {
    stage_all();
    for (int k = 0; k < p.top_k; ++k) {
      const int e = ids[k];
      if (e < 0 || e >= p.n_experts) continue;
      const float* xf = reinterpret_cast<const float*>(reinterpret_cast<const uint8_t*>(smem) + k * per);
      for (int r = 0; r < R; ++r)
        if (row0 + r < rows) acc[r] += wts[k] * generic_row_dot(p.blobs[e], p.m, row0 + r, xf, lane);
    }
  }
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const float v = warp_sum(acc[r]);
    if (lane == 0 && row0 + r < rows) {
      float* o = p.out + size_t(t) * rows + row0 + r;
      *o = p.accumulate ? *o + v : v;
    }
  }
}

// The down projection with a warp's lanes spread over (expert slot, chunk)
// pairs rather than over one expert's chunks: a row of K = 768 has only 24
// chunks, so a warp per (row, expert) leaves a quarter of its lanes idle and
// walks the experts one after another. Here item i = lane + 32 j of a warp is
// slot k = i / nchunks, chunk c = i % nchunks, all IPL items' weights are
// loaded before the token's top_k inputs are staged (one latency for both),
// and each lane sums its items weighted by their route weights.
// grid: (ceil(hidden / (kWarps * R)), tokens); a warp owns R output rows
// (2 halve the staging per row once enough blocks fill the GPU without it).
// Requires the fast layout and top_k * nchunks <= 32 * IPL.
template <int IPL, int R>
__global__ void __launch_bounds__(kThreads) q4_down_flat_kernel(DownParams p) {
  detail::allow_next_grid();
  // As q4_down_kernel: weights (and the router's ids) before the wait, h after.
  extern __shared__ uint4 smem[];
  const int2 place = grid_place(p.token_fastest);
  const int t = place.x, row_block = place.y;
  const int K = p.m.cols;
  const int nchunks = K / 32;
  const size_t per = staged_bytes(K, true);
  const int lane = threadIdx.x & 31;
  const int row0 = (row_block * kWarps + (threadIdx.x >> 5)) * R;
  const int rows = p.m.rows;
  const int total = p.top_k * nchunks;
  const int32_t* ids = p.expert_ids + size_t(t) * p.top_k;
  const float* wts = p.weights + size_t(t) * p.top_k;
  uint4 w[IPL][R];
  half2 sb[IPL][R];
  float rw[IPL];
  unsigned valid = 0;
#pragma unroll
  for (int j = 0; j < IPL; ++j) {
    const int i = lane + 32 * j;
    rw[j] = 0.f;
    if (i < total) {
      const int k = i / nchunks, c = i - k * nchunks;
      const int e = ids[k];
      // Inputs below the pair's split are the host's (h holds zeros there).
      const int lo = p.split ? p.split[size_t(t) * p.top_k + k] : 0;
      if (e >= 0 && e < p.n_experts && 32 * c >= lo) {
        const uint8_t* blob = p.blobs[e];
        const uint4* codes = reinterpret_cast<const uint4*>(blob + p.m.codes_offset) + c;
        const half2* params = reinterpret_cast<const half2*>(blob + p.m.params_offset) + (c >> p.group_shift);
#pragma unroll
        for (int r = 0; r < R; ++r)
          if (row0 + r < rows) {
            w[j][r] = __ldg(codes + size_t(row0 + r) * (K / 32));
            sb[j][r] = params[size_t(row0 + r) * (K / p.m.group)];
          }
        rw[j] = wts[k];
        valid |= 1u << j;
      }
    }
  }
  detail::wait_prior_grid();  // h comes from gate/up
  // top_k * nchunks <= 32 * IPL chunks, 8 items each: IPL rounds of kThreads
  stage_fast<IPL>(p.h + size_t(t) * p.top_k * K, nchunks, p.top_k, reinterpret_cast<uint8_t*>(smem), per);
  __syncthreads();
  float acc[R];
#pragma unroll
  for (int r = 0; r < R; ++r) acc[r] = 0.f;
#pragma unroll
  for (int j = 0; j < IPL; ++j) {
    if (!(valid >> j & 1u)) continue;
    const int i = lane + 32 * j;
    const int k = i / nchunks, c = i - k * nchunks;
    const uint8_t* base = reinterpret_cast<const uint8_t*>(smem) + size_t(k) * per;
    const float2 st = reinterpret_cast<const float2*>(base + size_t(nchunks) * 64)[c];
#pragma unroll
    for (int r = 0; r < R; ++r) {
      if (row0 + r >= rows) break;
      const float d = chunk_dot(w[j][r], reinterpret_cast<const uint4*>(base), nchunks, c);
      const float2 f = __half22float2(sb[j][r]);
      acc[r] = fmaf(rw[j], fmaf(f.x * st.x, d, f.y * st.y), acc[r]);
    }
  }
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const float v = warp_sum(acc[r]);
    if (lane == 0 && row0 + r < rows) {
      float* o = p.out + size_t(t) * rows + row0 + r;
      *o = p.accumulate ? *o + v : v;
    }
  }
}

// Items per lane of the flat down kernel for top_k * nchunks pairs; 0 when
// there are more than 8 a lane.
int down_flat_items(int pairs) {
  const int need = (pairs + 31) / 32;
  for (int ipl : {1, 2, 4, 6, 8})
    if (need <= ipl) return ipl;
  return 0;
}

int log2_int(int v) {
  int s = 0;
  while ((1 << s) < v) ++s;
  return s;
}

// Calls f(std::integral_constant<int, CPL>) for the chunks-per-lane count
// that covers K/32 chunks (1, 2 or 4).
template <typename F>
void with_cpl(int nchunks, F&& f) {
  if (nchunks <= 32) f(std::integral_constant<int, 1>{});
  else if (nchunks <= 64) f(std::integral_constant<int, 2>{});
  else f(std::integral_constant<int, 4>{});
}

template <typename Kernel>
Status set_smem(Kernel k, size_t bytes) {
  if (bytes > 48 * 1024)
    MOE_CUDA_TRY(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes)));
  return {};
}

Status check_matrix(const Q4MatrixLayout& m) {
  MOE_CUDA_REQUIRE(m.rows > 0 && m.cols > 0 && m.cols % 2 == 0, "matrix shape must be positive, cols even");
  MOE_CUDA_REQUIRE(m.group >= 2 && m.cols % m.group == 0, "group must divide cols");
  return {};
}

// A grid of (row blocks, pairs) with the pairs (or tokens) fastest: the
// blocks that read the same rows of different pairs' experts run together,
// so an expert two tokens share is mostly read once from device memory and
// then from L2 (batch 8, Qwen3-30B shape, resident: +1 %).
dim3 pairs_grid(int row_blocks, int pairs, bool pair_fastest) {
  return pair_fastest ? dim3(pairs, row_blocks) : dim3(row_blocks, pairs);
}

template <typename XT, bool GATE_UP>
Status launch_rows(RowsParams p, int pairs, cudaStream_t stream) {
  const bool fast = detail::q4_fast_layout(p.m0) && (!GATE_UP || detail::q4_fast_layout(p.m1));
  const int K = p.m0.cols;
  const size_t smem = staged_bytes(K, fast);
  Status st;
  cudaError_t lerr = cudaSuccess;
  if (fast) {
    p.group_shift = log2_int(p.m0.group / 32);
    with_cpl(K / 32, [&](auto cpl) {
      constexpr int C = decltype(cpl)::value;
      constexpr int R = GATE_UP ? 4 / C : 8 / C;  // about 40 registers of weights in flight per lane
      const int row_blocks = (p.m0.rows + kWarps * R - 1) / (kWarps * R);
      if constexpr (GATE_UP) {
        if (p.group && p.blobs && pairs > p.top_k && pairs <= 64) {
          auto kern = q4_gate_up_grouped_kernel<XT, C, R>;
          const size_t gsmem = staged_bytes(K, true) * kGroupVectors;
          st = set_smem(kern, gsmem);
          if (st.ok())
            lerr = detail::launch_pdl(kern, pairs_grid(row_blocks, pairs, p.pair_fastest), dim3(kThreads), gsmem,
                                      stream, p);
          return;
        }
      }
      auto kern = q4_rows_kernel<XT, C, true, GATE_UP, R>;
      st = set_smem(kern, smem);
      const dim3 grid = pairs_grid(row_blocks, pairs, p.pair_fastest);
      if (st.ok()) lerr = detail::launch_pdl(kern, grid, dim3(kThreads), smem, stream, p);
    });
  } else {
    auto kern = q4_rows_kernel<XT, 1, false, GATE_UP, 1>;
    st = set_smem(kern, smem);
    const dim3 grid = pairs_grid((p.m0.rows + kWarps - 1) / kWarps, pairs, p.pair_fastest);
    if (st.ok()) lerr = detail::launch_pdl(kern, grid, dim3(kThreads), smem, stream, p);
  }
  if (!st.ok()) return st;
  MOE_CUDA_TRY(lerr);
  MOE_CUDA_LAUNCHED();
  return {};
}

template <typename XT>
Status gemv_impl(const uint8_t* blob, const Q4MatrixLayout& m, const XT* x, float* y,
                 cudaStream_t stream) {
  MOE_CUDA_REQUIRE(blob && x && y, "null pointer");
  if (Status s = check_matrix(m); !s.ok()) return s;
  RowsParams p{};
  p.blob = blob;
  p.top_k = 1;
  p.m0 = m;
  p.x = x;
  p.y = y;
  return launch_rows<XT, false>(p, 1, stream);
}

Status check_expert_args(const Q4ExpertArgs& a) {
  MOE_CUDA_REQUIRE(a.blobs && a.expert_ids && a.route_weights, "null pointer");
  MOE_CUDA_REQUIRE(a.tokens > 0 && a.top_k > 0 && a.n_experts > 0, "tokens, top_k, n_experts must be positive");
  const ExpertLayout& L = a.layout;
  MOE_CUDA_REQUIRE(L.gate.rows == L.inter && L.gate.cols == L.hidden && L.up.rows == L.inter &&
                       L.up.cols == L.hidden && L.down.rows == L.hidden && L.down.cols == L.inter,
                   "expert layout inconsistent with (hidden, inter)");
  if (Status s = check_matrix(L.gate); !s.ok()) return s;
  if (Status s = check_matrix(L.up); !s.ok()) return s;
  return check_matrix(L.down);
}

template <typename XT>
Status gate_up_impl(const Q4ExpertArgs& a, const XT* x, float* h, cudaStream_t stream) {
  if (Status s = check_expert_args(a); !s.ok()) return s;
  MOE_CUDA_REQUIRE(x && h, "null pointer");
  RowsParams p{};
  p.blobs = a.blobs;
  p.expert_ids = a.expert_ids;
  p.n_experts = a.n_experts;
  p.top_k = a.top_k;
  p.m0 = a.layout.gate;
  p.m1 = a.layout.up;
  p.x = x;
  p.y = h;
  p.split = a.split;
  p.pairs = a.tokens * a.top_k;
  p.pair_fastest = a.tokens > 1;
  p.group = a.group_pairs;
  p.resident = a.resident;
  return launch_rows<XT, true>(p, p.pairs, stream);
}

}  // namespace

Status q4_gemv(const uint8_t* blob, const Q4MatrixLayout& m, const float* x, float* y,
               cudaStream_t stream) {
  return gemv_impl(blob, m, x, y, stream);
}
Status q4_gemv(const uint8_t* blob, const Q4MatrixLayout& m, const __nv_bfloat16* x, float* y,
               cudaStream_t stream) {
  return gemv_impl(blob, m, x, y, stream);
}

Status q4_expert_gate_up(const Q4ExpertArgs& a, const __nv_bfloat16* x, float* h,
                         cudaStream_t stream) {
  return gate_up_impl(a, x, h, stream);
}
Status q4_expert_gate_up(const Q4ExpertArgs& a, const float* x, float* h, cudaStream_t stream) {
  return gate_up_impl(a, x, h, stream);
}

Status q4_expert_down(const Q4ExpertArgs& a, const float* h, float* out, bool accumulate,
                      cudaStream_t stream) {
  if (Status s = check_expert_args(a); !s.ok()) return s;
  MOE_CUDA_REQUIRE(h && out, "null pointer");
  DownParams p{};
  p.blobs = a.blobs;
  p.expert_ids = a.expert_ids;
  p.weights = a.route_weights;
  p.n_experts = a.n_experts;
  p.top_k = a.top_k;
  p.m = a.layout.down;
  p.h = h;
  p.out = out;
  p.accumulate = accumulate;
  p.split = a.split;
  p.token_fastest = a.tokens > 1;
  const bool fast = detail::q4_fast_layout(p.m);
  const int K = p.m.cols;
  const size_t smem = staged_bytes(K, fast) * size_t(a.top_k);
  MOE_CUDA_REQUIRE(smem <= 200 * 1024, "top_k * inter too large for one block's shared memory");
  Status st;
  cudaError_t lerr = cudaSuccess;
  const int flat = fast ? down_flat_items(a.top_k * (K / 32)) : 0;
  // Two rows a warp halve the staging work per row, once there are enough
  // blocks to fill the GPU without it.
  const int blocks_r1 = (p.m.rows + kWarps - 1) / kWarps * a.tokens;
  const bool two = blocks_r1 >= 4 * 132 && K / 32 <= 64;
#ifdef MOE_DOWN_WARP_AT_BATCH
  const bool use_flat = flat > 0 && !two;
#else
  const bool use_flat = flat > 0 && flat <= (two ? 6 : 8);
#endif
  if (use_flat) {
    p.group_shift = log2_int(p.m.group / 32);
    auto launch = [&](auto ipl, auto rr) {
      constexpr int R = decltype(rr)::value;
      auto kern = q4_down_flat_kernel<decltype(ipl)::value, R>;
      st = set_smem(kern, smem);
      const dim3 grid = pairs_grid((p.m.rows + kWarps * R - 1) / (kWarps * R), a.tokens, p.token_fastest);
      if (st.ok()) lerr = detail::launch_pdl(kern, grid, dim3(kThreads), smem, stream, p);
    };
    auto with_r = [&](auto ipl) {
      if (two) {
        if constexpr (decltype(ipl)::value <= 6) launch(ipl, std::integral_constant<int, 2>{});
      } else {
        launch(ipl, std::integral_constant<int, 1>{});
      }
    };
    switch (flat) {
      case 1: with_r(std::integral_constant<int, 1>{}); break;
      case 2: with_r(std::integral_constant<int, 2>{}); break;
      case 4: with_r(std::integral_constant<int, 4>{}); break;
      case 6: with_r(std::integral_constant<int, 6>{}); break;
      default: with_r(std::integral_constant<int, 8>{}); break;
    }
  } else if (fast) {
    p.group_shift = log2_int(p.m.group / 32);
    with_cpl(K / 32, [&](auto cpl) {
      constexpr int C = decltype(cpl)::value;
      auto launch = [&](auto rr) {
        constexpr int R = decltype(rr)::value;
        auto kern = q4_down_kernel<C, true, R>;
        st = set_smem(kern, smem);
        const dim3 grid = pairs_grid((p.m.rows + kWarps * R - 1) / (kWarps * R), a.tokens, p.token_fastest);
        if (st.ok()) lerr = detail::launch_pdl(kern, grid, dim3(kThreads), smem, stream, p);
      };
      if (two && C <= 2) launch(std::integral_constant<int, 2>{});
      else launch(std::integral_constant<int, 1>{});
    });
  } else {
    auto kern = q4_down_kernel<1, false, 1>;
    st = set_smem(kern, smem);
    const dim3 grid = pairs_grid((p.m.rows + kWarps - 1) / kWarps, a.tokens, p.token_fastest);
    if (st.ok()) lerr = detail::launch_pdl(kern, grid, dim3(kThreads), smem, stream, p);
  }
  if (!st.ok()) return st;
  MOE_CUDA_TRY(lerr);
  MOE_CUDA_LAUNCHED();
  return {};
}

}  // namespace moe::cuda
