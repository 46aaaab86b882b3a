// The fused decode pass (fused_decode.cuh, docs/fused-decode.md): one
// persistent block a multiprocessor, 16 warps each; a layer's six phases
// separated by grid-wide barriers. Rows of every matrix are dealt to the
// grid's warps in turn (warp w of the grid takes rows w, w + W, ...), the
// same deal in the phase that reads them and in the one before that asks L2
// for them.
//
// Memory between blocks: whatever a block reads that another block wrote in
// this launch (the residual, q|k|v, attention's states, logits, the experts'
// hidden rows, the new K/V row) is read through L2 (ld.global.cg), never
// from an L1 line that may predate the write; weights and the pass's inputs,
// which nothing writes, go through the read-only path.
#include <cuda_bf16.h>

#include <algorithm>

#include "kernels/cuda/cuda_check.cuh"
#include "kernels/cuda/device_math.cuh"
#include "kernels/cuda/fused_decode.cuh"
#include "kernels/cuda/q4_dot.cuh"
#include "kernels/cuda/route_select.cuh"

namespace moe::cuda {
namespace {

constexpr int kThreads = 512;
constexpr int kWarps = kThreads / 32;
constexpr int kMaxGroup = 16;   // q heads a KV head
constexpr int kMaxRun = 256;    // keys one split of attention takes at most
constexpr int kMinRun = 16;     // ... and at least, while blocks are left over
constexpr int kMaxTopK = 32;
constexpr int kMaxHeadDim = 256;
constexpr int kMaxExperts = 1024;

using detail::FastRow;
using detail::stage_fast;
using detail::staged_bytes;
using detail::warp_sum;

__device__ __forceinline__ int ceil_div(int a, int b) { return (a + b - 1) / b; }
__device__ __forceinline__ float bf16_round(float v) { return __bfloat162float(__float2bfloat16_rn(v)); }
__device__ __forceinline__ float bf(__nv_bfloat16 v) { return __bfloat162float(v); }

__device__ __forceinline__ void prefetch_l2(const void* p) {
  asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
}

// Every block arrives, then all leave: the writes before it are seen by
// every block after it (as the cooperative groups' grid barrier does it).
// goal: this block's count of arrivals expected so far, the same in every block.
__device__ __forceinline__ void grid_sync(uint32_t* bar, uint32_t& goal) {
  goal += gridDim.x;
  __syncthreads();
  if (threadIdx.x == 0) {
    uint32_t seen;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 700
    // The add releases the block's writes (ordered before it by the block
    // barrier); the spin's loads acquire every other block's.
    asm volatile("atom.add.release.gpu.global.u32 %0, [%1], 1;" : "=r"(seen) : "l"(bar) : "memory");
    do {
      asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(seen) : "l"(bar) : "memory");
    } while (seen < goal);
#else
    __threadfence();
    atomicAdd(bar, 1u);
    do {
      seen = *reinterpret_cast<volatile uint32_t*>(bar);
    } while (seen < goal);
    __threadfence();
#endif
  }
  __syncthreads();
}

// Up to kPer values a thread of n (at most kPer * kThreads) from memory other
// blocks wrote, every load issued before any is used: one L2 latency, not
// one per value.
template <int kPer>
__device__ __forceinline__ void load_spread(const float* x, int n, float (&v)[kPer]) {
#pragma unroll
  for (int j = 0; j < kPer; ++j) {
    const int i = threadIdx.x + j * kThreads;
    v[j] = i < n ? __ldcg(x + i) : 0.f;
  }
}
constexpr int kSpread = 8;  // values a thread: hidden and the attention width up to 4,096

// ---- dense matrices (bf16 or INT8), one row a warp

// Inputs for rows of runs of W values (16 INT8 weights or 8 bf16 ones in 16
// bytes): input i at (i % W) * runs + i / W, so that lane c's run reads
// consecutive words with its neighbours (no bank conflicts).
template <int W>
__device__ __forceinline__ int run_slot(int i, int runs) {
  return (i % W) * runs + i / W;
}

// xs <- bf16(norm_w * x / rms(x)), as the GEMVs' RMSNorm staging rounds it.
// W = 1: the plain order (the experts' inputs).
template <int W>
__device__ void stage_normed(const float* x, const __nv_bfloat16* norm_w, float eps, int n, float* xs,
                             float* scratch) {
  float v[kSpread];
  load_spread(x, n, v);
  float ss = 0.f;
#pragma unroll
  for (int j = 0; j < kSpread; ++j) ss += v[j] * v[j];
  const float inv = rsqrtf(detail::block_sum(ss, scratch) / float(n) + eps);
  const int runs = n / W;
#pragma unroll
  for (int j = 0; j < kSpread; ++j) {
    const int i = threadIdx.x + j * kThreads;
    if (i < n) xs[run_slot<W>(i, runs)] = bf16_round(bf(norm_w[i]) * (v[j] * inv));
  }
  __syncthreads();
}

template <int W>
__device__ void stage_plain(const float* x, int n, float* xs) {
  float v[kSpread];
  load_spread(x, n, v);
  const int runs = n / W;
#pragma unroll
  for (int j = 0; j < kSpread; ++j) {
    const int i = threadIdx.x + j * kThreads;
    if (i < n) xs[run_slot<W>(i, runs)] = v[j];
  }
  __syncthreads();
}

// Sixteen INT8 values or eight bf16 values (16 bytes) as floats.
template <bool I8>
__device__ __forceinline__ void unpack_run(const uint4& v, float (&f)[I8 ? 16 : 8]) {
  if constexpr (I8) {
    detail::i8x4_to_floats(v.x, f);
    detail::i8x4_to_floats(v.y, f + 4);
    detail::i8x4_to_floats(v.z, f + 8);
    detail::i8x4_to_floats(v.w, f + 12);
  } else {
    detail::bf16x8_to_float(v, f);
  }
}

// Rows row0, row0 + stride, ... (kRows of them, those below `rows`) of m
// [rows, cols] dotted with the staged inputs, every row's loads issued
// before any is used; every lane gets the sums.
template <bool I8, int kRows>
__device__ __forceinline__ void dense_rows(const FusedMatrix& m, int row0, int stride, int rows, int cols,
                                           const float* xs, int lane, float (&out)[kRows]) {
  constexpr int W = I8 ? 16 : 8;
  constexpr int kBatch = 4;
  const int runs = cols / W;
  float acc[kRows];
#pragma unroll
  for (int r = 0; r < kRows; ++r) acc[r] = 0.f;
  for (int c0 = 0; c0 < runs; c0 += 32 * kBatch) {
    uint4 v[kRows][kBatch];
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const int row = row0 + r * stride;
      const uint4* src = I8 ? reinterpret_cast<const uint4*>(m.q + size_t(row) * cols)
                            : reinterpret_cast<const uint4*>(m.w + size_t(row) * cols);
#pragma unroll
      for (int j = 0; j < kBatch; ++j) {
        const int c = c0 + lane + 32 * j;
        if (row < rows && c < runs) v[r][j] = __ldg(src + c);
      }
    }
#pragma unroll
    for (int r = 0; r < kRows; ++r)
#pragma unroll
      for (int j = 0; j < kBatch; ++j) {
        const int c = c0 + lane + 32 * j;
        if (row0 + r * stride < rows && c < runs) {
          float f[W];
          unpack_run<I8>(v[r][j], f);
#pragma unroll
          for (int e = 0; e < W; ++e) acc[r] = fmaf(f[e], xs[e * runs + c], acc[r]);
        }
      }
  }
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const int row = row0 + r * stride;
    out[r] = warp_sum(acc[r]);
    if (I8 && row < rows) out[r] *= __ldg(m.scale + row);
  }
}

// Every row of m dealt to the grid's warps, two a warp at a time;
// emit(row, sum) on lane 0.
template <bool I8, typename Emit>
__device__ __forceinline__ void dense_phase(const FusedMatrix& m, int rows, int cols, const float* xs, int gw,
                                            int GW, int lane, Emit emit) {
  for (int r = gw; r < rows; r += 2 * GW) {
    float out[2];
    dense_rows<I8, 2>(m, r, GW, rows, cols, xs, lane, out);
    if (lane == 0) {
      emit(r, out[0]);
      if (r + GW < rows) emit(r + GW, out[1]);
    }
  }
}

// Asks L2 for the rows of m this warp will read (rows gw, gw + GW, ...).
__device__ void prefetch_rows(const FusedMatrix& m, int rows, int cols, int gw, int GW, int lane) {
  const size_t row_bytes = size_t(cols) * (m.q ? 1 : 2);
  const uint8_t* base = m.q ? reinterpret_cast<const uint8_t*>(m.q) : reinterpret_cast<const uint8_t*>(m.w);
  for (int r = gw; r < rows; r += GW)
    for (size_t off = size_t(lane) * 128; off < row_bytes; off += 32 * 128) prefetch_l2(base + size_t(r) * row_bytes + off);
}

// ---- attention

// Head `head` of the token's q|k|v (q heads, then k, then v): bias, the q or
// k norm (per head, or full width with inv_full), RoPE for q and k, rounded
// to bf16 as the chain stores q and the KV rows. One warp; out: head_dim floats.
__device__ void head_vector(const FusedDecodeArgs& a, const FusedLayer& L, int head, int pos, float inv_full,
                            float* out, int lane) {
  const int HD = a.head_dim, half = HD / 2;
  const bool is_q = head < a.n_heads, is_k = !is_q && head < a.n_heads + a.n_kv;
  float ss = 0.f;
  for (int i = lane; i < HD; i += 32) {
    float v = __ldcg(a.qkv + size_t(head) * HD + i);
    if (L.qkv_b) v += bf(L.qkv_b[size_t(head) * HD + i]);
    out[i] = v;
    ss += v * v;
  }
  const __nv_bfloat16* nw = is_q ? L.q_norm : (is_k ? L.k_norm : nullptr);
  __syncwarp();
  if (nw && a.qk_norm_full_width) {
    const __nv_bfloat16* w = nw + size_t(is_q ? head : head - a.n_heads) * HD;
    for (int i = lane; i < HD; i += 32) out[i] = bf(w[i]) * (out[i] * inv_full);
    __syncwarp();
  } else if (nw) {
    const float inv = rsqrtf(warp_sum(ss) / float(HD) + a.eps);
    for (int i = lane; i < HD; i += 32) out[i] = bf(nw[i]) * (out[i] * inv);
    __syncwarp();
  }
  if (is_q || is_k) {
    for (int i = lane; i < half; i += 32) {
      float sn, cs;
      sincosf(float(pos) * a.inv_freq[i], &sn, &cs);
      cs *= a.attention_factor;
      sn *= a.attention_factor;
      const float x0 = out[i], x1 = out[i + half];
      out[i] = x0 * cs - x1 * sn;
      out[i + half] = x1 * cs + x0 * sn;
    }
    __syncwarp();
  }
  for (int i = lane; i < HD; i += 32) out[i] = bf16_round(out[i]);
  __syncwarp();
}

// The inverse RMS of the token's q (or k) part of q|k|v with its bias, over
// `width` values from `first` (the full-width norms). Whole block.
__device__ float part_inverse_rms(const FusedDecodeArgs& a, const FusedLayer& L, int first, int width,
                                 float* scratch) {
  float ss = 0.f;
  for (int i = threadIdx.x; i < width; i += kThreads) {
    float v = __ldcg(a.qkv + first + i);
    if (L.qkv_b) v += bf(L.qkv_b[first + i]);
    ss += v * v;
  }
  return rsqrtf(detail::block_sum(ss, scratch) / float(width) + a.eps);
}

__device__ __forceinline__ int64_t kv_row(const FusedDecodeArgs& a, const FusedLayer& L, int key, int kvh) {
  const int64_t blk = __ldg(a.block_table + key / a.block_tokens);
  return blk * L.kv_block_stride + int64_t(key % a.block_tokens) * a.n_kv * a.head_dim + int64_t(kvh) * a.head_dim;
}

// The splits of `keys` keys on this grid: runs of at most kMaxRun keys, and
// of at least kMinRun while the KV heads' runs leave blocks idle.
__device__ __forceinline__ int attention_run(int keys, int n_kv, int max_splits) {
  int s = max(ceil_div(keys, kMaxRun), min(ceil_div(keys, kMinRun), max(1, int(gridDim.x) / n_kv)));
  s = min(s, max_splits);
  return ceil_div(keys, s);
}

// Items (KV head g, run s) dealt to the blocks; each takes the group's q
// heads over its run of keys, and the run holding the token stores the new
// K/V row first. A run's softmax state goes to the partials; the last run of
// a KV head to finish merges them into attn (one run: straight into attn).
__device__ void attention_phase(const FusedDecodeArgs& a, const FusedLayer& L, int pos, float* smem,
                                float* scratch) {
  __shared__ float stat[2 * kMaxGroup];
  __shared__ bool last_block;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int HD = a.head_dim, G = a.n_heads / a.n_kv, keys = pos + 1;
  const int run = attention_run(keys, a.n_kv, a.max_splits);
  const int S = ceil_div(keys, run);
  if (int(blockIdx.x) >= a.n_kv * S) return;  // no item here (uniform per block)
  float* qs = smem;                    // [G][HD]
  float* sc = qs + G * HD;             // [G][kMaxRun] scores, then probabilities
  float* red = sc + G * kMaxRun;       // [groups][G][HD] P.V sums; first the new K and V rows
  const bool full = a.qk_norm_full_width;
  const float inv_q = full && L.q_norm ? part_inverse_rms(a, L, 0, a.n_heads * HD, scratch) : 0.f;
  const float inv_k = full && L.k_norm ? part_inverse_rms(a, L, a.n_heads * HD, a.n_kv * HD, scratch) : 0.f;
  const int groups = kThreads / HD;    // threads a dimension of P.V
  for (int it = blockIdx.x; it < a.n_kv * S; it += gridDim.x) {
    const int g = it / S, s = it - g * S;
    const int k0 = s * run, k1 = min(keys, k0 + run);
    for (int hh = warp; hh < G; hh += kWarps) head_vector(a, L, g * G + hh, pos, inv_q, qs + hh * HD, lane);
    if (k1 == keys && warp >= kWarps - 2) {
      // The token's K (last warp) and V (the one before) row of this KV head.
      const bool is_k = warp == kWarps - 1;
      float* row = red + (is_k ? 0 : HD);
      head_vector(a, L, a.n_heads + (is_k ? 0 : a.n_kv) + g, pos, inv_k, row, lane);
      __nv_bfloat16* dst = (is_k ? L.k_pool : L.v_pool) + kv_row(a, L, pos, g);
      for (int i = lane; i < HD; i += 32) dst[i] = __float2bfloat16_rn(row[i]);
      __threadfence();  // in L2 before this block's reads of it below
    }
    __syncthreads();
    // Scores: a warp a key, every head of the group.
    constexpr int kKeys = 4;  // keys a warp loads at once
    constexpr int kPerLane = kMaxHeadDim / 32;
    for (int j0 = k0 + warp * kKeys; j0 < k1; j0 += kWarps * kKeys) {
      __nv_bfloat16 kb[kKeys][kPerLane];
#pragma unroll
      for (int u = 0; u < kKeys; ++u) {
        const int j = j0 + u;
        const __nv_bfloat16* kr = L.k_pool + kv_row(a, L, min(j, k1 - 1), g);
#pragma unroll
        for (int i = 0; i < kPerLane; ++i) {
          const int d = lane + 32 * i;
          kb[u][i] = d < HD && j < k1 ? __ldcg(kr + d) : __float2bfloat16_rn(0.f);
        }
      }
#pragma unroll
      for (int u = 0; u < kKeys; ++u) {
        if (j0 + u >= k1) break;
        for (int hh = 0; hh < G; ++hh) {
          float p = 0.f;
#pragma unroll
          for (int i = 0; i < kPerLane; ++i) {
            const int d = lane + 32 * i;
            if (d < HD) p = fmaf(qs[hh * HD + d], bf(kb[u][i]), p);
          }
          p = warp_sum(p);
          if (lane == 0) sc[hh * kMaxRun + (j0 + u - k0)] = p * a.softmax_scale;
        }
      }
    }
    __syncthreads();
    for (int hh = warp; hh < G; hh += kWarps) {
      float* srow = sc + hh * kMaxRun;
      float m = -INFINITY;
      for (int j = lane; j < k1 - k0; j += 32) m = fmaxf(m, srow[j]);
      m = detail::warp_max(m);
      float l = 0.f;
      for (int j = lane; j < k1 - k0; j += 32) {
        const float p = __expf(srow[j] - m);
        srow[j] = p;
        l += p;
      }
      l = warp_sum(l);
      if (lane == 0) {
        stat[2 * hh] = m;
        stat[2 * hh + 1] = l;
      }
    }
    __syncthreads();
    // P.V: thread (group, d) sums its keys for every head.
    {
      const int d = threadIdx.x % HD, grp = threadIdx.x / HD;
      float acc[kMaxGroup];
#pragma unroll
      for (int hh = 0; hh < kMaxGroup; ++hh) acc[hh] = 0.f;
      if (grp < groups) {
        constexpr int kKeys = 4;
        for (int j0 = k0 + grp; j0 < k1; j0 += groups * kKeys) {
          float v[kKeys];
#pragma unroll
          for (int u = 0; u < kKeys; ++u) {
            const int j = j0 + u * groups;
            v[u] = j < k1 ? bf(__ldcg(L.v_pool + kv_row(a, L, j, g) + d)) : 0.f;
          }
#pragma unroll
          for (int u = 0; u < kKeys; ++u) {
            const int j = j0 + u * groups;
            if (j >= k1) break;
#pragma unroll
            for (int hh = 0; hh < kMaxGroup; ++hh)
              if (hh < G) acc[hh] = fmaf(sc[hh * kMaxRun + (j - k0)], v[u], acc[hh]);
          }
        }
#pragma unroll
        for (int hh = 0; hh < kMaxGroup; ++hh)
          if (hh < G) red[(grp * G + hh) * HD + d] = acc[hh];
      }
    }
    __syncthreads();
    const int stride = HD + 2;
    for (int o = threadIdx.x; o < G * HD; o += kThreads) {
      const int hh = o / HD, d = o - hh * HD;
      float sum = 0.f;
      for (int grp = 0; grp < groups; ++grp) sum += red[(grp * G + hh) * HD + d];
      if (S == 1) {
        a.attn[size_t(g * G + hh) * HD + d] = bf16_round(sum / stat[2 * hh + 1]);
      } else {
        float* part = a.partials + ((size_t(g) * a.max_splits + s) * G + hh) * stride;
        part[d] = sum;
        if (d == 0) {
          part[HD] = stat[2 * hh];
          part[HD + 1] = stat[2 * hh + 1];
        }
      }
    }
    if (S > 1) {
      __syncthreads();
      if (threadIdx.x == 0) {
        __threadfence();
        last_block = atomicAdd(a.counts + g, 1u) == uint32_t(S - 1);
      }
      __syncthreads();
      if (last_block) {
        __threadfence();
        for (int o = threadIdx.x; o < G * HD; o += kThreads) {
          const int hh = o / HD, d = o - hh * HD;
          const float* part0 = a.partials + (size_t(g) * a.max_splits * G + hh) * stride;
          const size_t step = size_t(G) * stride;
          float M = -INFINITY;
          for (int r = 0; r < S; ++r) M = fmaxf(M, __ldcg(part0 + r * step + HD));
          float num = 0.f, den = 0.f;
          for (int r = 0; r < S; ++r) {
            const float w = __expf(__ldcg(part0 + r * step + HD) - M);
            num = fmaf(w, __ldcg(part0 + r * step + d), num);
            den = fmaf(w, __ldcg(part0 + r * step + HD + 1), den);
          }
          a.attn[size_t(g * G + hh) * HD + d] = bf16_round(num / den);
        }
        if (threadIdx.x == 0) a.counts[g] = 0u;
      }
    }
    __syncthreads();  // the next item reuses the shared memory
  }
}

// ---- the pass

__device__ __forceinline__ uint64_t global_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t));
  return t;
}

// A phase's end: block 0 stamps its arrival, the barrier, then its leaving.
struct PhaseEnd {
  const FusedDecodeArgs& a;
  uint32_t goal = 0;
  int at = 1;
  __device__ void operator()(bool barrier = true) {
    const bool stamp = a.stamps && blockIdx.x == 0 && threadIdx.x == 0;
    if (stamp) a.stamps[at] = global_ns();
    if (barrier) grid_sync(a.barrier, goal);
    if (stamp) a.stamps[at + 1] = global_ns();
    at += 2;
  }
};

template <bool I8, int CPL_D>
__global__ void __launch_bounds__(kThreads, 1) fused_decode_kernel(FusedDecodeArgs a) {
  extern __shared__ __align__(16) uint8_t smem_raw[];
  float* smem = reinterpret_cast<float*>(smem_raw);
  __shared__ float scratch[kWarps];
  __shared__ int32_t s_ids[kMaxTopK];
  __shared__ float s_w[kMaxTopK];
  __shared__ const uint8_t* s_blob[kMaxTopK];
  constexpr int W = I8 ? 16 : 8;
  // Experts whose down rows a warp loads together: more would spill at the
  // 128 registers a thread of a 512-thread block has (the rows were asked of
  // L2 during gate|up, so fewer loads in flight suffice).
  constexpr int kDownGroup = CPL_D == 1 ? 4 : 2;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int gw = blockIdx.x * kWarps + warp, GW = gridDim.x * kWarps;
  const int pos = __ldg(a.position);
  const int HD = a.head_dim, hidden = a.hidden, E = a.n_experts, K = a.top_k;
  const int qkv_width = (a.n_heads + 2 * a.n_kv) * HD, q_width = a.n_heads * HD;
  const ExpertLayout& lay = a.layout;
  const int inter = lay.inter;
  const int h_chunks = hidden / 32, i_chunks = inter / 32;
  const int gu_shift = __ffs(lay.gate.group >> 5) - 1, down_shift = __ffs(lay.down.group >> 5) - 1;
  PhaseEnd end{a};
  if (a.stamps && blockIdx.x == 0 && threadIdx.x == 0) a.stamps[0] = global_ns();
  if (a.n_layers > 0) prefetch_rows(a.layers[0].qkv, qkv_width, hidden, gw, GW, lane);
  for (int l = 0; l < a.n_layers; ++l) {
    const FusedLayer& L = a.layers[l];
    // 1. RMSNorm + q|k|v.
    stage_normed<W>(a.x, L.in_norm, a.eps, hidden, smem, scratch);
    dense_phase<I8>(L.qkv, qkv_width, hidden, smem, gw, GW, lane, [&](int r, float v) { a.qkv[r] = v; });
    end();
    // 2. Attention (o's rows asked for meanwhile).
    prefetch_rows(L.o, hidden, q_width, gw, GW, lane);
    attention_phase(a, L, pos, smem, scratch);
    end();
    // 3. o, added to the residual.
    prefetch_rows(L.router, E, hidden, gw, GW, lane);
    stage_plain<W>(a.attn, q_width, smem);
    dense_phase<I8>(L.o, hidden, q_width, smem, gw, GW, lane, [&](int r, float v) { a.x[r] = __ldcg(a.x + r) + v; });
    end();
    // 4. RMSNorm + router.
    stage_normed<W>(a.x, L.post_norm, a.eps, hidden, smem, scratch);
    dense_phase<I8>(L.router, E, hidden, smem, gw, GW, lane, [&](int r, float v) { a.logits[r] = v; });
    end();
    // 5. Top-k in every block, then gate|up + SiLU.
    {
      float* lg = smem;          // [E] logits
      float* p = lg + E;         // [E] probabilities
      for (int i = threadIdx.x; i < E; i += kThreads) lg[i] = __ldcg(a.logits + i);
      __syncthreads();
      if (warp == 0) {
        detail::select_top_k_warp(lg, E, K, a.renormalize, a.routed_scaling, p, s_ids, s_w);
        if (a.forced && lane == 0) {
          if (a.route.trace) {
            const int r = detail::replay_row_of(__ldg(a.route.seq_of_token), pos, a.route.trace_tokens);
            const int16_t* src = a.route.trace + (size_t(r) * a.route.trace_layers + l) * K;
            for (int j = 0; j < K; ++j) s_ids[j] = src[j];
          } else {
            detail::draw_uniform(s_ids, E, K, pos, __ldg(a.route.seq_of_token), l, a.route.seed);
          }
        }
        __syncwarp();
        if (lane < K) {
          s_blob[lane] = L.blobs[s_ids[lane]];
          if (blockIdx.x == 0) L.ids[lane] = s_ids[lane];
        }
      }
      __syncthreads();
    }
    // This warp's gate|up rows and down rows of the chosen experts, asked
    // of L2 now: the loads below then meet them on their way.
    for (int u = gw; u < K * inter; u += GW) {
      const int k = u / inter, r = u - k * inter;
      const size_t code_bytes = size_t(hidden) / 2;
      for (int i = lane; i < 2 * 32; i += 32) {
        const Q4MatrixLayout& m = i < 32 ? lay.gate : lay.up;
        const size_t off = size_t(i & 31) * 128;
        if (off < code_bytes) prefetch_l2(s_blob[k] + m.codes_offset + size_t(r) * code_bytes + off);
      }
    }
    for (int r = gw; r < hidden; r += GW)
      for (int i = lane; i < K * 4; i += 32) {
        const int k = i >> 2, part = i & 3;
        const uint8_t* blob = s_blob[k];
        const size_t code_bytes = size_t(inter) / 2;
        if (part < 3) {
          const size_t off = size_t(part) * 128;
          if (off < code_bytes) prefetch_l2(blob + lay.down.codes_offset + size_t(r) * code_bytes + off);
        } else {
          prefetch_l2(blob + lay.down.params_offset + size_t(r) * (inter / lay.down.group) * 4);
        }
      }
    {
      float* xf = smem;                                          // [hidden] xn
      uint8_t* sb = reinterpret_cast<uint8_t*>(smem + hidden);  // staged
      stage_normed<1>(a.x, L.post_norm, a.eps, hidden, xf, scratch);
      stage_fast<2>(xf, h_chunks, 1, sb, 0);
      __syncthreads();
      const uint4* xs = reinterpret_cast<const uint4*>(sb);
      const float2* st = reinterpret_cast<const float2*>(sb + size_t(h_chunks) * 64);
      for (int u = gw; u < K * inter; u += GW) {
        const int k = u / inter, r = u - k * inter;
        FastRow<4> g, up;
        g.load(s_blob[k], lay.gate, r, h_chunks, gu_shift, lane);
        up.load(s_blob[k], lay.up, r, h_chunks, gu_shift, lane);
        const float av = warp_sum(g.dot(xs, st, h_chunks, lane));
        const float bv = warp_sum(up.dot(xs, st, h_chunks, lane));
        if (lane == 0) a.h[u] = detail::silu(av) * bv;
      }
    }
    end();
    // 6. Down, weighted by the routes, added to the residual (the next
    // layer's q|k|v rows asked for meanwhile).
    if (l + 1 < a.n_layers) prefetch_rows(a.layers[l + 1].qkv, qkv_width, hidden, gw, GW, lane);
    {
      float* hf = smem;                                                 // [K * inter]
      uint8_t* sb = reinterpret_cast<uint8_t*>(smem + size_t(K) * inter);
      const size_t per = staged_bytes(inter, true);
      for (int i0 = 0; i0 < K * inter; i0 += kSpread * kThreads) {
        float v[kSpread];
        load_spread(a.h + i0, K * inter - i0, v);
#pragma unroll
        for (int j = 0; j < kSpread; ++j) {
          const int i = i0 + threadIdx.x + j * kThreads;
          if (i < K * inter) hf[i] = v[j];
        }
      }
      __syncthreads();
      stage_fast<2>(hf, i_chunks, K, sb, per);
      __syncthreads();
      for (int r = gw; r < hidden; r += GW) {
        float acc = 0.f;
        for (int k0 = 0; k0 < K; k0 += kDownGroup) {
          FastRow<CPL_D> fr[kDownGroup];
#pragma unroll
          for (int j = 0; j < kDownGroup; ++j)
            if (k0 + j < K) fr[j].load(s_blob[k0 + j], lay.down, r, i_chunks, down_shift, lane);
#pragma unroll
          for (int j = 0; j < kDownGroup; ++j) {
            if (k0 + j >= K) break;
            const uint8_t* base = sb + size_t(k0 + j) * per;
            acc += s_w[k0 + j] * fr[j].dot(reinterpret_cast<const uint4*>(base),
                                             reinterpret_cast<const float2*>(base + size_t(i_chunks) * 64), i_chunks,
                                             lane);
          }
        }
        acc = warp_sum(acc);
        if (lane == 0) a.x[r] = __ldcg(a.x + r) + acc;
      }
    }
    end(l + 1 < a.n_layers);
  }
}

using KernelFn = void (*)(FusedDecodeArgs);

KernelFn kernel_for(const FusedDecodeArgs& a) {
  const bool down_one = a.layout.inter / 32 <= 32;
  if (a.int8) return down_one ? fused_decode_kernel<true, 1> : fused_decode_kernel<true, 4>;
  return down_one ? fused_decode_kernel<false, 1> : fused_decode_kernel<false, 4>;
}

size_t smem_bytes(const FusedDecodeArgs& a) {
  const size_t f = sizeof(float);
  const int G = a.n_kv > 0 ? a.n_heads / a.n_kv : 1;
  const size_t dense = size_t(std::max(a.hidden, a.n_heads * a.head_dim)) * f;
  const size_t attention = (size_t(G) * a.head_dim + size_t(G) * kMaxRun + size_t(kThreads) * G) * f;
  const size_t route = size_t(2) * a.n_experts * f;
  const size_t gate_up = size_t(a.hidden) * f + staged_bytes(a.hidden, true);
  const size_t down = size_t(a.top_k) * a.layout.inter * f + size_t(a.top_k) * staged_bytes(a.layout.inter, true);
  return std::max({dense, attention, route, gate_up, down});
}

}  // namespace

int fused_decode_max_splits(int max_context, int n_kv, int blocks) {
  if (n_kv <= 0) return 1;
  return std::max({1, (max_context + kMaxRun - 1) / kMaxRun, blocks / n_kv});
}

size_t fused_decode_partials_floats(int max_context, int n_kv, int n_heads, int head_dim, int blocks) {
  return size_t(fused_decode_max_splits(max_context, n_kv, blocks)) * n_heads * (head_dim + 2);
}

int fused_decode_blocks(int device) {
  int sms = 0;
  if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess) return 0;
  return sms;
}

std::string fused_decode_unsupported(const FusedDecodeArgs& a, int device) {
  if (a.n_kv <= 0 || a.n_heads % a.n_kv != 0) return "the q heads are not a multiple of the KV heads";
  if (a.n_heads / a.n_kv > kMaxGroup) return "more than 16 q heads share a KV head";
  if (a.head_dim % 2 != 0 || a.head_dim > kMaxHeadDim) return "head_dim is odd or above 256";
  const int W = a.int8 ? 16 : 8;
  if (a.hidden % W != 0 || (a.n_heads * a.head_dim) % W != 0) return "a dense width is not a whole number of 16-byte runs";
  if (a.top_k < 1 || a.top_k > kMaxTopK || a.n_experts < a.top_k || a.n_experts > kMaxExperts)
    return "top_k above 32 or experts above 1,024";
  if (a.layout.hidden != a.hidden || !detail::q4_fast_layout(a.layout.gate) ||
      !detail::q4_fast_layout(a.layout.up) || !detail::q4_fast_layout(a.layout.down))
    return "the experts' widths or groups are outside the fast INT4 layout (multiples of 32, at most 4,096)";
  int coop = 0, optin = 0;
  if (cudaDeviceGetAttribute(&coop, cudaDevAttrCooperativeLaunch, device) != cudaSuccess || !coop)
    return "the device cannot launch cooperatively";
  if (cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device) != cudaSuccess) return "no device";
  const size_t smem = smem_bytes(a);
  if (smem + 1024 > size_t(optin)) return "the pass needs more shared memory a block than the device has";
  const KernelFn k = kernel_for(a);
  // The limit is the kernel's, not this engine's: every engine in the
  // process shares it, so it only ever rises (an engine setting its own
  // smaller size would fail the launches of a larger one created before).
  cudaFuncAttributes fa{};
  if (cudaFuncGetAttributes(&fa, k) != cudaSuccess) return "the kernel's attributes could not be read";
  if (size_t(fa.maxDynamicSharedSizeBytes) < smem &&
      cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)) != cudaSuccess)
    return "the kernel's shared memory could not be raised";
  int per_sm = 0;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, k, kThreads, smem) != cudaSuccess || per_sm < 1)
    return "a block of the pass does not fit a multiprocessor";
  return {};
}

Status fused_decode(const FusedDecodeArgs& a, int blocks, cudaStream_t stream) {
  MOE_CUDA_REQUIRE(a.layers && a.n_layers > 0 && a.x && a.qkv && a.attn && a.logits && a.h && a.barrier &&
                       a.position && a.block_table && a.inv_freq,
                   "null pointer");
  MOE_CUDA_REQUIRE(blocks > 0 && a.max_splits >= 1 && (a.max_splits == 1 || (a.partials && a.counts)),
                   "blocks and the partials");
  MOE_CUDA_TRY(cudaMemsetAsync(a.barrier, 0, sizeof(uint32_t), stream));
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(blocks);
  cfg.blockDim = dim3(kThreads);
  cfg.dynamicSmemBytes = smem_bytes(a);
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeCooperative;
  attr[0].val.cooperative = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  MOE_CUDA_TRY(cudaLaunchKernelEx(&cfg, kernel_for(a), a));
  MOE_CUDA_LAUNCHED();
  return {};
}

}  // namespace moe::cuda
