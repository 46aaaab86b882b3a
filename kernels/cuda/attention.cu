// One block per (query token, head), 8 warps splitting the keys in tiles of
// 32. Scores: a lane owns a key and dots the whole key row with q (no
// shuffles, 16-byte loads). Values: lanes own head dims and each key's
// probability is broadcast. Warps keep online-softmax state (max, sum, out)
// and merge through shared memory at the end.
//
// Small heads (16, 32) cannot give every lane of a warp its own head dims in
// the value phase, so there a key's row is spread over head_dim / 2 lanes
// (two dims each, 4-byte loads) and a warp takes 64 / head_dim keys at once;
// the key groups' partial outputs are summed with shuffles after the last
// tile. Heads of 64 and up keep one key per step over the whole warp.
//
// Coded rows (int8, fp8; docs/kv-cache.md): the same walk over one-byte
// codes, 16 a 16-byte load in the score phase and D a D-byte load in the
// value phase, decoded in registers; a key's score is its dot times its K
// scale, and its probability is multiplied by its V scale before the
// broadcast (the softmax sum keeps the plain probability).
#include <cuda_fp8.h>

#include "kernels/cuda/attention.cuh"
#include "kernels/cuda/cuda_check.cuh"
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/device_math.cuh"

namespace moe::cuda {
namespace {

constexpr int kWarps = 8;
constexpr int kThreads = kWarps * 32;

// One code's value before its scale.
template <KvDtype C>
__device__ __forceinline__ float decode_code(uint32_t byte) {
  if constexpr (C == KvDtype::fp8) {
    const __half_raw h = __nv_cvt_fp8_to_halfraw(__nv_fp8_storage_t(byte), __NV_E4M3);
    return __half2float(__half(h));
  } else {
    return float(int8_t(uint8_t(byte)));
  }
}

// D consecutive codes (D = 2, 4 or 8) as one 2-, 4- or 8-byte load.
template <int D, KvDtype C>
__device__ __forceinline__ void load_code_part(const uint8_t* p, float* out) {
  uint32_t w[2] = {0, 0};
  if constexpr (D == 2) {
    w[0] = *reinterpret_cast<const uint16_t*>(p);
  } else if constexpr (D == 4) {
    w[0] = *reinterpret_cast<const uint32_t*>(p);
  } else {
    const uint2 u = *reinterpret_cast<const uint2*>(p);
    w[0] = u.x, w[1] = u.y;
  }
#pragma unroll
  for (int i = 0; i < D; ++i) out[i] = decode_code<C>((w[i / 4] >> (8 * (i % 4))) & 0xffu);
}

// A value row's part: bf16 values, or codes.
template <int D, KvDtype C>
__device__ __forceinline__ void load_value_part(const PagedKvPool& kv, int64_t elem, float* out) {
  if constexpr (C == KvDtype::bf16) detail::load_row_part<D>(kv.v + elem, out);
  else load_code_part<D, C>(kv.v_codes + elem, out);
}

template <int HD, KvDtype C>
__global__ void __launch_bounds__(kThreads) attention_kernel(AttentionArgs a, PagedKvPool kv) {
  detail::allow_next_grid();
  detail::wait_prior_grid();
  static_assert(HD == 16 || HD == 32 || HD == 64 || HD == 128 || HD == 256, "unsupported head_dim");
  constexpr bool kSmall = HD < 64;
  // Head dims per lane in the value phase; small heads: 2, and a key's row
  // over kLanesPerKey lanes, kKeysPerStep keys side by side in a warp.
  constexpr int D = kSmall ? 2 : HD / 32;
  constexpr int kLanesPerKey = kSmall ? HD / 2 : 32;
  constexpr int kKeysPerStep = 32 / kLanesPerKey;
  __shared__ float qs[HD];
  __shared__ float wm[kWarps], wl[kWarps];
  __shared__ float wo[kWarps][HD];
  __shared__ bool merge_here;
  const int t = blockIdx.x, h = blockIdx.y, split = blockIdx.z;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int kvh = h / (a.n_heads / kv.n_kv);
  const int n_keys = a.positions[t] + 1;
  // This block's keys [k_begin, k_end): the query's 32-key tiles dealt out
  // evenly to `splits` runs, each at least split_keys long (split_keys a
  // multiple of 32, so every run holds floor(tiles / splits) >= 1 tiles).
  const int splits = min(a.max_splits, max(1, n_keys / a.split_keys));
  if (split >= splits) return;  // a short query's unused blocks
  const int tiles = (n_keys + 31) / 32;
  const int k_begin = split * tiles / splits * 32, k_end = min(n_keys, (split + 1) * tiles / splits * 32);
  const __nv_bfloat16* q = a.q + (size_t(t) * a.n_heads + h) * HD;
  for (int i = threadIdx.x; i < HD; i += kThreads) qs[i] = __bfloat162float(q[i]) * a.scale;
  __syncthreads();
  const int32_t* table = kv.block_tables + size_t(a.seq_of_token[t]) * kv.max_blocks;
  const int64_t row_stride = int64_t(kv.n_kv) * HD;  // elements per slot
  const int64_t bstride = kv.block_elems(), sstride = kv.block_scales();

  float m = -INFINITY, l = 0.f;
  float o[D];
#pragma unroll
  for (int i = 0; i < D; ++i) o[i] = 0.f;

  for (int tile = k_begin / 32 + warp; tile * 32 < k_end; tile += kWarps) {
    const int j = tile * 32 + lane;
    float s = -INFINITY;
    int64_t slot = 0;  // this lane's key's slot: its first element (every head's rows)
    float vscale = 0.f;  // coded rows: this lane's key's V scale
    if (j < k_end) {
      const int64_t blk = table[j / kv.block_tokens], in_blk = j % kv.block_tokens;
      slot = blk * bstride + in_blk * row_stride;
      float d = 0.f;
      if constexpr (C == KvDtype::bf16) {
        const uint4* kr = reinterpret_cast<const uint4*>(kv.k + slot + int64_t(kvh) * HD);
#pragma unroll
        for (int c = 0; c < HD / 8; ++c) {
          const uint4 u = __ldg(kr + c);
          const __nv_bfloat162* b = reinterpret_cast<const __nv_bfloat162*>(&u);
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const float2 f = __bfloat1622float2(b[e]);
            d = fmaf(f.x, qs[c * 8 + 2 * e], d);
            d = fmaf(f.y, qs[c * 8 + 2 * e + 1], d);
          }
        }
      } else {
        const uint4* kr = reinterpret_cast<const uint4*>(kv.k_codes + slot + int64_t(kvh) * HD);
#pragma unroll
        for (int c = 0; c < HD / 16; ++c) {
          const uint4 u = __ldg(kr + c);
          const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
          for (int e = 0; e < 16; ++e) d = fmaf(decode_code<C>((w[e / 4] >> (8 * (e % 4))) & 0xffu), qs[c * 16 + e], d);
        }
        const int64_t row = blk * sstride + in_blk * kv.n_kv + kvh;
        d *= __ldg(kv.k_scales + row);
        vscale = __ldg(kv.v_scales + row);
      }
      s = d;
    }
    const float m_new = fmaxf(m, detail::warp_max(s));
    const float p_plain = j < k_end ? __expf(s - m_new) : 0.f;
    const float corr = __expf(m - m_new);  // 0 on the first tile (m = -inf)
    l = l * corr + detail::warp_sum(p_plain);
    // The weight of the key's value row: its V scale folded in when coded.
    const float p = C == KvDtype::bf16 ? p_plain : p_plain * vscale;
#pragma unroll
    for (int i = 0; i < D; ++i) o[i] *= corr;
    m = m_new;
    const int valid = min(32, k_end - tile * 32);
    if constexpr (kSmall) {
      // Lane group g = lane / kLanesPerKey takes keys g, g + kKeysPerStep, ...
      // of the tile; eight steps' loads are in flight before their FMAs.
      const int group = lane / kLanesPerKey, dim0 = (lane % kLanesPerKey) * D;
      for (int j0 = 0; j0 < valid; j0 += 8 * kKeysPerStep) {
        float pv[8];
        float vv[8][D];
#pragma unroll
        for (int u = 0; u < 8; ++u) {
          const int jj = j0 + u * kKeysPerStep + group;  // key within the tile
          const float pj = __shfl_sync(0xffffffffu, p, jj & 31);
          const int64_t sj = __shfl_sync(0xffffffffu, (long long)slot, jj & 31);
          if (jj < valid) {
            pv[u] = pj;
            load_value_part<D, C>(kv, sj + int64_t(kvh) * HD + dim0, vv[u]);
          } else {
            pv[u] = 0.f;
#pragma unroll
            for (int i = 0; i < D; ++i) vv[u][i] = 0.f;
          }
        }
#pragma unroll
        for (int u = 0; u < 8; ++u)
#pragma unroll
          for (int i = 0; i < D; ++i) o[i] = fmaf(pv[u], vv[u][i], o[i]);
      }
    } else {
      // Eight keys' value rows are loaded before their FMAs, so eight loads
      // are in flight per lane instead of one.
      for (int j0 = 0; j0 < valid; j0 += 8) {
        float pv[8];
        float vv[8][D];
#pragma unroll
        for (int u = 0; u < 8; ++u) {
          pv[u] = __shfl_sync(0xffffffffu, p, j0 + u);  // p is 0 past the last key
          const int64_t sj = __shfl_sync(0xffffffffu, (long long)slot, j0 + u);
          if (j0 + u < valid) {
            load_value_part<D, C>(kv, sj + int64_t(kvh) * HD + lane * D, vv[u]);
          } else {
#pragma unroll
            for (int i = 0; i < D; ++i) vv[u][i] = 0.f;
          }
        }
#pragma unroll
        for (int u = 0; u < 8; ++u)
#pragma unroll
          for (int i = 0; i < D; ++i) o[i] = fmaf(pv[u], vv[u][i], o[i]);
      }
    }
  }
  if (lane == 0) {
    wm[warp] = m;
    wl[warp] = l;
  }
  if constexpr (kSmall) {
    // Sum the key groups' partial outputs (same dims, lanes kLanesPerKey apart).
#pragma unroll
    for (int off = kLanesPerKey; off < 32; off <<= 1)
#pragma unroll
      for (int i = 0; i < D; ++i) o[i] += __shfl_xor_sync(0xffffffffu, o[i], off);
    if (lane < kLanesPerKey)
#pragma unroll
      for (int i = 0; i < D; ++i) wo[warp][lane * D + i] = o[i];
  } else {
#pragma unroll
    for (int i = 0; i < D; ++i) wo[warp][lane * D + i] = o[i];
  }
  __syncthreads();
  float M = -INFINITY;
  for (int w = 0; w < kWarps; ++w) M = fmaxf(M, wm[w]);
  float L = 0.f;
  for (int w = 0; w < kWarps; ++w) L += wm[w] == -INFINITY ? 0.f : wl[w] * __expf(wm[w] - M);
  __nv_bfloat16* out = a.out + (size_t(t) * a.n_heads + h) * HD;
  if (splits == 1) {
    for (int i = threadIdx.x; i < HD; i += kThreads) {
      float acc = 0.f;
      for (int w = 0; w < kWarps; ++w)
        if (wm[w] != -INFINITY) acc += wo[w][i] * __expf(wm[w] - M);
      out[i] = __float2bfloat16(acc / L);
    }
    return;
  }
  // This run's state (max, sum, unnormalised output) for the merge; the
  // last of the query's blocks to finish merges them all in split order.
  const size_t th = size_t(t) * a.n_heads + h;
  float* part = a.partials + (th * a.max_splits + split) * (HD + 2);
  if (threadIdx.x == 0) part[0] = M, part[1] = L;
  for (int i = threadIdx.x; i < HD; i += kThreads) {
    float acc = 0.f;
    for (int w = 0; w < kWarps; ++w)
      if (wm[w] != -INFINITY) acc += wo[w][i] * __expf(wm[w] - M);
    part[2 + i] = acc;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();  // this run's state, before its arrival
    merge_here = atomicAdd(a.split_counts + th, 1u) == uint32_t(splits - 1);
    if (merge_here) {
      a.split_counts[th] = 0;  // ready for the next call
      __threadfence();
    }
  }
  __syncthreads();
  if (!merge_here) return;
  const float* parts = a.partials + th * a.max_splits * (HD + 2);
  float MM = -INFINITY;
  for (int sp = 0; sp < splits; ++sp) MM = fmaxf(MM, __ldcg(parts + size_t(sp) * (HD + 2)));
  float LL = 0.f;
  for (int sp = 0; sp < splits; ++sp) {
    const float ms = __ldcg(parts + size_t(sp) * (HD + 2));
    if (ms != -INFINITY) LL += __ldcg(parts + size_t(sp) * (HD + 2) + 1) * __expf(ms - MM);
  }
  for (int i = threadIdx.x; i < HD; i += kThreads) {
    float acc = 0.f;
    for (int sp = 0; sp < splits; ++sp) {
      const float ms = __ldcg(parts + size_t(sp) * (HD + 2));
      if (ms != -INFINITY) acc += __ldcg(parts + size_t(sp) * (HD + 2) + 2 + i) * __expf(ms - MM);
    }
    out[i] = __float2bfloat16(acc / LL);
  }
}

// ---- Query tiles (prompts): a block per (kQueryTile tokens, head).
// Per 32-key tile the block stages K and V as floats in shared memory (coded
// rows decoded and scaled there), then each query's 8 threads score 4 keys
// apiece (float4 dots over the head) and keep its online softmax state, and
// each thread accumulates 4 * HD / 32 of its query's output dims. A tile of
// several sequences' tokens is walked one run of a sequence at a time, the
// other queries masked; a run reads keys up to its last position.
constexpr int kQueryTile = 16;
constexpr int kKeyTile = 32;
constexpr int kTileThreads = kQueryTile * 8;

// Key row r of the tile (key j0 + r of the run's sequence) into ks/vs, HD/8
// pieces of 8 values a row; rows past `keys` become zeros.
template <int HD, KvDtype C>
__device__ __forceinline__ void stage_kv_tile(const PagedKvPool& kv, const int32_t* table, int kvh, int j0, int keys,
                                              float (*ks)[HD + 4], float (*vs)[HD]) {
  constexpr int kPieces = HD / 8;
  const int64_t row_stride = int64_t(kv.n_kv) * HD;
  const int64_t bstride = kv.block_elems(), sstride = kv.block_scales();
  for (int i = threadIdx.x; i < kKeyTile * kPieces; i += kTileThreads) {
    const int r = i / kPieces, c = i % kPieces, j = j0 + r;
    float kf[8], vf[8];
    if (j < keys) {
      const int64_t blk = table[j / kv.block_tokens], in_blk = j % kv.block_tokens;
      const int64_t elem = blk * bstride + in_blk * row_stride + int64_t(kvh) * HD + c * 8;
      if constexpr (C == KvDtype::bf16) {
        detail::load_row_part<8>(kv.k + elem, kf);
        detail::load_row_part<8>(kv.v + elem, vf);
      } else {
        load_code_part<8, C>(kv.k_codes + elem, kf);
        load_code_part<8, C>(kv.v_codes + elem, vf);
        const int64_t row = blk * sstride + in_blk * kv.n_kv + kvh;
        const float kscale = __ldg(kv.k_scales + row), vscale = __ldg(kv.v_scales + row);
#pragma unroll
        for (int e = 0; e < 8; ++e) kf[e] *= kscale, vf[e] *= vscale;
      }
    } else {
#pragma unroll
      for (int e = 0; e < 8; ++e) kf[e] = vf[e] = 0.f;
    }
    float4* kd = reinterpret_cast<float4*>(&ks[r][c * 8]);
    float4* vd = reinterpret_cast<float4*>(&vs[r][c * 8]);
    kd[0] = make_float4(kf[0], kf[1], kf[2], kf[3]);
    kd[1] = make_float4(kf[4], kf[5], kf[6], kf[7]);
    vd[0] = make_float4(vf[0], vf[1], vf[2], vf[3]);
    vd[1] = make_float4(vf[4], vf[5], vf[6], vf[7]);
  }
}

template <int HD, KvDtype C>
__global__ void __launch_bounds__(kTileThreads) attention_tiles_kernel(AttentionArgs a, PagedKvPool kv) {
  detail::allow_next_grid();
  detail::wait_prior_grid();
  static_assert(HD == 32 || HD == 64 || HD == 128, "query tiles take head_dim 32, 64 or 128");
  constexpr int kDims = HD / 8;   // output dims a thread: 4 at sub * 4 + 32 u
  constexpr int kKeys = kKeyTile / 8;  // keys a thread scores: sub + 8 m
  // Rows padded by 4 floats: the 8 key rows a query's lanes read at once
  // (and the 4 query rows of a warp) fall in distinct banks.
  __shared__ __align__(16) float qs[kQueryTile][HD + 4];
  __shared__ __align__(16) float ks[kKeyTile][HD + 4];
  __shared__ __align__(16) float vs[kKeyTile][HD];
  __shared__ float ps[kQueryTile][kKeyTile + 1];
  __shared__ int32_t qseq[kQueryTile], qpos[kQueryTile];
  const int t0 = blockIdx.x * kQueryTile, h = blockIdx.y;
  const int kvh = h / (a.n_heads / kv.n_kv);
  const int qi = threadIdx.x >> 3, sub = threadIdx.x & 7;
  for (int i = threadIdx.x; i < kQueryTile * HD; i += kTileThreads) {
    const int r = i / HD, d = i % HD, t = t0 + r;
    qs[r][d] = t < a.tokens ? __bfloat162float(a.q[(size_t(t) * a.n_heads + h) * HD + d]) * a.scale : 0.f;
  }
  if (threadIdx.x < kQueryTile) {
    const int t = t0 + threadIdx.x;
    qseq[threadIdx.x] = t < a.tokens ? a.seq_of_token[t] : -1;
    qpos[threadIdx.x] = t < a.tokens ? a.positions[t] : -1;
  }
  __syncthreads();
  const int my_pos = qpos[qi];
  float m = -INFINITY, l = 0.f;
  float o[kDims];
#pragma unroll
  for (int i = 0; i < kDims; ++i) o[i] = 0.f;
  for (int run = 0; run < kQueryTile && qseq[run] >= 0;) {
    // The run: tokens [run, end) of one sequence; its keys reach its last position.
    const int seq = qseq[run];
    int end = run, last = -1;
    while (end < kQueryTile && qseq[end] == seq) last = max(last, qpos[end++]);
    const int keys = last + 1;
    const bool active = qi >= run && qi < end;
    const int32_t* table = kv.block_tables + size_t(seq) * kv.max_blocks;
    for (int j0 = 0; j0 < keys; j0 += kKeyTile) {
      stage_kv_tile<HD, C>(kv, table, kvh, j0, keys, ks, vs);
      __syncthreads();
      float s[kKeys];
#pragma unroll
      for (int u = 0; u < kKeys; ++u) s[u] = 0.f;
#pragma unroll 4
      for (int d = 0; d < HD; d += 4) {
        const float4 q4 = *reinterpret_cast<const float4*>(&qs[qi][d]);
#pragma unroll
        for (int u = 0; u < kKeys; ++u) {
          const float4 k4 = *reinterpret_cast<const float4*>(&ks[sub + 8 * u][d]);
          s[u] = fmaf(q4.x, k4.x, fmaf(q4.y, k4.y, fmaf(q4.z, k4.z, fmaf(q4.w, k4.w, s[u]))));
        }
      }
      float mx = -INFINITY;
#pragma unroll
      for (int u = 0; u < kKeys; ++u) {
        const int j = j0 + sub + 8 * u;
        if (!active || j > my_pos) s[u] = -INFINITY;
        mx = fmaxf(mx, s[u]);
      }
      // The query's 8 lanes are lanes 8g..8g+7 of its warp.
#pragma unroll
      for (int off = 1; off < 8; off <<= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
      const float m_new = fmaxf(m, mx);
      const float corr = m_new == -INFINITY ? 1.f : __expf(m - m_new);  // 0 on the first keys (m = -inf)
      float sum = 0.f;
#pragma unroll
      for (int u = 0; u < kKeys; ++u) {
        const float p = s[u] == -INFINITY ? 0.f : __expf(s[u] - m_new);
        ps[qi][sub + 8 * u] = p;
        sum += p;
      }
#pragma unroll
      for (int off = 1; off < 8; off <<= 1) sum += __shfl_xor_sync(0xffffffffu, sum, off);
      l = l * corr + sum;
      m = m_new;
#pragma unroll
      for (int i = 0; i < kDims; ++i) o[i] *= corr;
      __syncthreads();
      if (active) {
        const int n_valid = min(kKeyTile, min(keys, my_pos + 1) - j0);
        for (int j = 0; j < n_valid; ++j) {
          const float p = ps[qi][j];
#pragma unroll
          for (int u = 0; u < kDims / 4; ++u) {
            const float4 v4 = *reinterpret_cast<const float4*>(&vs[j][sub * 4 + 32 * u]);
            o[4 * u] = fmaf(p, v4.x, o[4 * u]);
            o[4 * u + 1] = fmaf(p, v4.y, o[4 * u + 1]);
            o[4 * u + 2] = fmaf(p, v4.z, o[4 * u + 2]);
            o[4 * u + 3] = fmaf(p, v4.w, o[4 * u + 3]);
          }
        }
      }
      __syncthreads();  // ks, vs and ps are restaged next
    }
    run = end;
  }
  const int t = t0 + qi;
  if (t >= a.tokens) return;
  const float inv = 1.f / l;  // l > 0: key 0 is every query's
  __nv_bfloat16* out = a.out + (size_t(t) * a.n_heads + h) * HD;
#pragma unroll
  for (int u = 0; u < kDims / 4; ++u) {
    __nv_bfloat162 lo = __floats2bfloat162_rn(o[4 * u] * inv, o[4 * u + 1] * inv);
    __nv_bfloat162 hi = __floats2bfloat162_rn(o[4 * u + 2] * inv, o[4 * u + 3] * inv);
    uint2 w;
    memcpy(&w.x, &lo, 4);
    memcpy(&w.y, &hi, 4);
    *reinterpret_cast<uint2*>(out + sub * 4 + 32 * u) = w;
  }
}

template <KvDtype C>
Status launch_attention_tiles(const AttentionArgs& a, const PagedKvPool& kv, cudaStream_t stream) {
  const dim3 grid((a.tokens + kQueryTile - 1) / kQueryTile, a.n_heads);
  switch (kv.head_dim) {
    case 32: MOE_CUDA_TRY(detail::launch_pdl(attention_tiles_kernel<32, C>, grid, dim3(kTileThreads), 0, stream, a, kv)); break;
    case 64: MOE_CUDA_TRY(detail::launch_pdl(attention_tiles_kernel<64, C>, grid, dim3(kTileThreads), 0, stream, a, kv)); break;
    case 128: MOE_CUDA_TRY(detail::launch_pdl(attention_tiles_kernel<128, C>, grid, dim3(kTileThreads), 0, stream, a, kv)); break;
    default:
      return make_error("paged_attention: query tiles take head_dim 32, 64 or 128, not " + std::to_string(kv.head_dim));
  }
  MOE_CUDA_LAUNCHED();
  return {};
}

template <KvDtype C>
Status launch_attention(const AttentionArgs& a, const PagedKvPool& kv, cudaStream_t stream) {
  const bool tiles = a.walk == AttentionWalk::query_tiles ||
                     (a.walk == AttentionWalk::automatic && a.shortest_run >= kQueryTile &&
                      attention_query_tiles_supported(kv.head_dim));
  if (tiles) return launch_attention_tiles<C>(a, kv, stream);
  MOE_CUDA_REQUIRE(a.max_splits >= 1 && a.max_splits <= kAttentionMaxSplits &&
                       (a.max_splits == 1 || (a.partials && a.split_counts)),
                   "max_splits in [1, 16], with partials and split_counts above 1");
  MOE_CUDA_REQUIRE(a.split_keys >= 32 && a.split_keys % 32 == 0, "split_keys a positive multiple of 32");
  const dim3 grid(a.tokens, a.n_heads, a.max_splits);
  switch (kv.head_dim) {
    case 16: MOE_CUDA_TRY(detail::launch_pdl(attention_kernel<16, C>, dim3(grid), dim3(kThreads), 0, stream, a, kv)); break;
    case 32: MOE_CUDA_TRY(detail::launch_pdl(attention_kernel<32, C>, dim3(grid), dim3(kThreads), 0, stream, a, kv)); break;
    case 64: MOE_CUDA_TRY(detail::launch_pdl(attention_kernel<64, C>, dim3(grid), dim3(kThreads), 0, stream, a, kv)); break;
    case 128: MOE_CUDA_TRY(detail::launch_pdl(attention_kernel<128, C>, dim3(grid), dim3(kThreads), 0, stream, a, kv)); break;
    case 256: MOE_CUDA_TRY(detail::launch_pdl(attention_kernel<256, C>, dim3(grid), dim3(kThreads), 0, stream, a, kv)); break;
    default:
      return make_error("paged_attention: unsupported head_dim " + std::to_string(kv.head_dim) +
                        " (supported: 16, 32, 64, 128, 256)");
  }
  MOE_CUDA_LAUNCHED();
  return {};
}

}  // namespace

bool attention_query_tiles_supported(int head_dim) { return head_dim == 32 || head_dim == 64 || head_dim == 128; }

Status paged_attention(const AttentionArgs& a, const PagedKvPool& kv, cudaStream_t stream) {
  const bool coded = kv_coded(kv.dtype);
  MOE_CUDA_REQUIRE(a.q && a.out && a.seq_of_token && a.positions && kv.block_tables, "null pointer");
  MOE_CUDA_REQUIRE(coded ? (kv.k_codes && kv.v_codes && kv.k_scales && kv.v_scales) : (kv.k && kv.v),
                   "null pool pointer");
  MOE_CUDA_REQUIRE(a.tokens > 0 && a.n_heads > 0 && kv.n_kv > 0 && a.n_heads % kv.n_kv == 0,
                   "n_heads must be a positive multiple of n_kv");
  MOE_CUDA_REQUIRE(kv.block_tokens > 0 && kv.max_blocks > 0, "bad block geometry");
  switch (kv.dtype) {
    case KvDtype::bf16: return launch_attention<KvDtype::bf16>(a, kv, stream);
    case KvDtype::int8: return launch_attention<KvDtype::int8>(a, kv, stream);
    case KvDtype::fp8: return launch_attention<KvDtype::fp8>(a, kv, stream);
  }
  return make_error("paged_attention: unknown KV dtype");
}

}  // namespace moe::cuda
