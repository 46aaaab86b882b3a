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

// ---- Query tiles (prompts) on tensor cores: a block of four warps, each
// warp 16 consecutive tokens of one head, m16n8k16 bf16 MMAs with f32
// accumulators. The block's warps share a KV head: four heads of a query
// group over the same 16 tokens where the group has 4k heads, two heads over
// 32 tokens where it has 2k, else one head over 64 tokens. Per 64-key tile
// the block stages K and V rows as bf16 in shared memory (coded rows as
// their codes, which bf16 holds exactly, their scales beside them); each
// warp scores its 16 x 64 block (its queries held as A fragments, K rows
// by ldmatrix), keeps the online softmax of its rows in registers (a lane
// holds two rows, four lanes share a row), and multiplies the
// probabilities, rounded to bf16, by V (ldmatrix.trans). A K scale
// multiplies its key's scores, a V scale its key's probabilities before the
// multiply (the softmax sum keeps the plain ones). A tile of several
// sequences' tokens is walked one run of a sequence at a time, the rows of
// other runs masked; a run stages keys up to its last position, and a warp
// skips the key tiles past its own rows' positions.
constexpr int kQueryTile = 16;                       // tokens a warp
constexpr int kPromptWarps = 4;
constexpr int kPromptThreads = kPromptWarps * 32;
constexpr int kPromptKeys = 64;                      // keys a staged tile
constexpr int kPromptRowsMax = kQueryTile * kPromptWarps;

template <int HD>
struct PromptTile {
  // Rows padded by 16 bytes: the 8 rows one ldmatrix reads fall in distinct banks.
  __nv_bfloat16 k[kPromptKeys][HD + 8];
  __nv_bfloat16 v[kPromptKeys][HD + 8];
  float kscale[kPromptKeys], vscale[kPromptKeys];
};

// Eight one-byte codes as eight bf16 values (exact: int8, and fp8 e4m3's
// 3-bit mantissa, fit bf16's 7).
template <KvDtype C>
__device__ __forceinline__ uint4 codes_as_bf16(uint2 w) {
  uint32_t out[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const uint32_t word = (i < 2 ? w.x : w.y) >> (16 * (i % 2));
    out[i] = detail::bf16x2_bits(decode_code<C>(word & 0xffu), decode_code<C>((word >> 8) & 0xffu));
  }
  return make_uint4(out[0], out[1], out[2], out[3]);
}

// Keys j0 .. j0 + 63 of the run's sequence into `s`; rows past `keys` become
// zeros (their scores are masked; zero values keep the products finite).
template <int HD, KvDtype C>
__device__ __forceinline__ void stage_prompt_tile(const PagedKvPool& kv, const int32_t* table, int kvh, int j0,
                                                  int keys, PromptTile<HD>& s) {
  constexpr int kPieces = HD / 8;
  const int64_t row_stride = int64_t(kv.n_kv) * HD;
  const int64_t bstride = kv.block_elems(), sstride = kv.block_scales();
  for (int i = threadIdx.x; i < kPromptKeys * kPieces; i += kPromptThreads) {
    const int r = i / kPieces, c = i % kPieces, j = j0 + r;
    uint4 kw = make_uint4(0, 0, 0, 0), vw = kw;
    if (j < keys) {
      const int64_t blk = table[j / kv.block_tokens], in_blk = j % kv.block_tokens;
      const int64_t elem = blk * bstride + in_blk * row_stride + int64_t(kvh) * HD + c * 8;
      if constexpr (C == KvDtype::bf16) {
        kw = *reinterpret_cast<const uint4*>(kv.k + elem);
        vw = *reinterpret_cast<const uint4*>(kv.v + elem);
      } else {
        kw = codes_as_bf16<C>(*reinterpret_cast<const uint2*>(kv.k_codes + elem));
        vw = codes_as_bf16<C>(*reinterpret_cast<const uint2*>(kv.v_codes + elem));
      }
    }
    *reinterpret_cast<uint4*>(&s.k[r][c * 8]) = kw;
    *reinterpret_cast<uint4*>(&s.v[r][c * 8]) = vw;
  }
  if constexpr (C != KvDtype::bf16) {
    for (int r = threadIdx.x; r < kPromptKeys; r += kPromptThreads) {
      const int j = j0 + r;
      float ks = 0.f, vs = 0.f;
      if (j < keys) {
        const int64_t blk = table[j / kv.block_tokens], in_blk = j % kv.block_tokens;
        const int64_t row = blk * sstride + in_blk * kv.n_kv + kvh;
        ks = __ldg(kv.k_scales + row);
        vs = __ldg(kv.v_scales + row);
      }
      s.kscale[r] = ks;
      s.vscale[r] = vs;
    }
  }
}

// heads_per_block: 4, 2 or 1, dividing the query group; the block's tokens
// are 16 x (4 / heads_per_block).
template <int HD, KvDtype C>
__global__ void __launch_bounds__(kPromptThreads)
    attention_tiles_kernel(AttentionArgs a, PagedKvPool kv, int heads_per_block) {
  detail::allow_next_grid();
  detail::wait_prior_grid();
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  static_assert(HD == 32 || HD == 64 || HD == 128, "query tiles take head_dim 32, 64 or 128");
  constexpr bool kCoded = C != KvDtype::bf16;
  constexpr int kChunks = HD / 16;             // k steps of the scores
  constexpr int kDimTiles = HD / 8;            // n tiles of the output
  constexpr int kKeyTiles = kPromptKeys / 8;   // n tiles of the scores
  __shared__ __align__(16) PromptTile<HD> st;
  __shared__ int32_t qseq[kPromptRowsMax], qpos[kPromptRowsMax];
  const int hb = heads_per_block, rows = kQueryTile * (kPromptWarps / hb);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, c = lane & 3;
  const int h = blockIdx.y * hb + warp % hb;
  const int kvh = blockIdx.y * hb / (a.n_heads / kv.n_kv);
  const int r0 = kQueryTile * (warp / hb);  // the warp's first row of the block's
  const int t0 = blockIdx.x * rows;
  for (int i = threadIdx.x; i < rows; i += kPromptThreads) {
    const int t = t0 + i;
    qseq[i] = t < a.tokens ? a.seq_of_token[t] : -1;
    qpos[i] = t < a.tokens ? a.positions[t] : -1;
  }
  // The warp's queries as A fragments: rows g and g + 8, dims 16 kc + 2c (+ 8).
  uint32_t qa[kChunks][4];
  {
    const int ta = t0 + r0 + g, tb = ta + 8;
    const __nv_bfloat16* pa = a.q + (size_t(ta) * a.n_heads + h) * HD + 2 * c;
    const __nv_bfloat16* pb = a.q + (size_t(tb) * a.n_heads + h) * HD + 2 * c;
#pragma unroll
    for (int kc = 0; kc < kChunks; ++kc) {
      qa[kc][0] = ta < a.tokens ? *reinterpret_cast<const uint32_t*>(pa + 16 * kc) : 0u;
      qa[kc][1] = tb < a.tokens ? *reinterpret_cast<const uint32_t*>(pb + 16 * kc) : 0u;
      qa[kc][2] = ta < a.tokens ? *reinterpret_cast<const uint32_t*>(pa + 16 * kc + 8) : 0u;
      qa[kc][3] = tb < a.tokens ? *reinterpret_cast<const uint32_t*>(pb + 16 * kc + 8) : 0u;
    }
  }
  __syncthreads();
  const float scale_log2 = a.scale * 1.4426950408889634f;  // scores in log2 units: exp2 below
  const int my_pos[2] = {qpos[r0 + g], qpos[r0 + g + 8]};
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};  // l: this lane's part of its rows' sums
  float o[kDimTiles][4];
#pragma unroll
  for (int dt = 0; dt < kDimTiles; ++dt) o[dt][0] = o[dt][1] = o[dt][2] = o[dt][3] = 0.f;
  for (int run = 0; run < rows && qseq[run] >= 0;) {
    // The run: rows [run, end) of one sequence; its keys reach its last position.
    const int seq = qseq[run];
    int end = run, last = -1;
    while (end < rows && qseq[end] == seq) last = max(last, qpos[end++]);
    const int keys = last + 1;
    const bool active[2] = {r0 + g >= run && r0 + g < end, r0 + g + 8 >= run && r0 + g + 8 < end};
    int reach = -1;  // the last key any of the warp's rows of this run sees
    for (int i = max(run, r0); i < min(end, r0 + kQueryTile); ++i) reach = max(reach, qpos[i]);
    const int32_t* table = kv.block_tables + size_t(seq) * kv.max_blocks;
    for (int j0 = 0; j0 < keys; j0 += kPromptKeys) {
      __syncthreads();  // the last tile's readers are done with it
      stage_prompt_tile<HD, C>(kv, table, kvh, j0, keys, st);
      __syncthreads();
      if (reach < j0) continue;
      float s[kKeyTiles][4];
#pragma unroll
      for (int nt = 0; nt < kKeyTiles; ++nt) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.f;
#pragma unroll
      for (int kc = 0; kc < kChunks; ++kc) {
#pragma unroll
        for (int nt = 0; nt < kKeyTiles; nt += 2) {
          // Matrices: keys of n tiles nt and nt + 1, dims 16 kc and 16 kc + 8.
          uint32_t b[4];
          detail::ldmatrix_x4(b, &st.k[nt * 8 + (lane >> 4) * 8 + (lane & 7)][16 * kc + ((lane >> 3) & 1) * 8]);
          detail::mma_bf16_16816(s[nt], qa[kc][0], qa[kc][1], qa[kc][2], qa[kc][3], b[0], b[1]);
          detail::mma_bf16_16816(s[nt + 1], qa[kc][0], qa[kc][1], qa[kc][2], qa[kc][3], b[2], b[3]);
        }
      }
      // s[nt][e]: row g + 8 (e / 2), key j0 + 8 nt + 2c + e % 2.
      float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
      for (int nt = 0; nt < kKeyTiles; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int row = e >> 1, jj = nt * 8 + 2 * c + (e & 1);
          float v = s[nt][e];
          if constexpr (kCoded) v *= st.kscale[jj];
          v = active[row] && j0 + jj <= my_pos[row] ? v * scale_log2 : -INFINITY;
          s[nt][e] = v;
          mx[row] = fmaxf(mx[row], v);
        }
      }
      float corr[2];
#pragma unroll
      for (int row = 0; row < 2; ++row) {
        mx[row] = fmaxf(mx[row], __shfl_xor_sync(0xffffffffu, mx[row], 1));
        mx[row] = fmaxf(mx[row], __shfl_xor_sync(0xffffffffu, mx[row], 2));
        const float m_new = fmaxf(m[row], mx[row]);
        corr[row] = m_new == -INFINITY ? 1.f : exp2f(m[row] - m_new);  // 0 on a row's first keys
        m[row] = m_new;
        l[row] *= corr[row];
      }
#pragma unroll
      for (int nt = 0; nt < kKeyTiles; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int row = e >> 1;
          const float p = s[nt][e] == -INFINITY ? 0.f : exp2f(s[nt][e] - m[row]);
          l[row] += p;
          s[nt][e] = kCoded ? p * st.vscale[nt * 8 + 2 * c + (e & 1)] : p;
        }
      }
#pragma unroll
      for (int dt = 0; dt < kDimTiles; ++dt) {
        o[dt][0] *= corr[0], o[dt][1] *= corr[0];
        o[dt][2] *= corr[1], o[dt][3] *= corr[1];
      }
#pragma unroll
      for (int kc = 0; kc < kPromptKeys / 16; ++kc) {
        if (j0 + 16 * kc > reach) break;  // masked keys: zero probabilities
        // The probabilities of keys 16 kc .. 16 kc + 15 as an A fragment:
        // the scores' D layout of n tiles 2 kc and 2 kc + 1 is A's layout.
        const uint32_t p0 = detail::bf16x2_bits(s[2 * kc][0], s[2 * kc][1]);
        const uint32_t p1 = detail::bf16x2_bits(s[2 * kc][2], s[2 * kc][3]);
        const uint32_t p2 = detail::bf16x2_bits(s[2 * kc + 1][0], s[2 * kc + 1][1]);
        const uint32_t p3 = detail::bf16x2_bits(s[2 * kc + 1][2], s[2 * kc + 1][3]);
#pragma unroll
        for (int dt = 0; dt < kDimTiles; dt += 2) {
          // Matrices: keys 16 kc and 16 kc + 8, dims of n tiles dt and dt + 1.
          uint32_t b[4];
          detail::ldmatrix_x4<true>(b, &st.v[16 * kc + ((lane >> 3) & 1) * 8 + (lane & 7)][8 * dt + (lane >> 4) * 8]);
          detail::mma_bf16_16816(o[dt], p0, p1, p2, p3, b[0], b[1]);
          detail::mma_bf16_16816(o[dt + 1], p0, p1, p2, p3, b[2], b[3]);
        }
      }
    }
    run = end;
  }
#pragma unroll
  for (int row = 0; row < 2; ++row) {
    l[row] += __shfl_xor_sync(0xffffffffu, l[row], 1);
    l[row] += __shfl_xor_sync(0xffffffffu, l[row], 2);
    const int t = t0 + r0 + g + 8 * row;
    if (t >= a.tokens) continue;
    const float inv = 1.f / l[row];  // > 0: key 0 is every query's
    __nv_bfloat16* out = a.out + (size_t(t) * a.n_heads + h) * HD + 2 * c;
#pragma unroll
    for (int dt = 0; dt < kDimTiles; ++dt)
      *reinterpret_cast<uint32_t*>(out + 8 * dt) = detail::bf16x2_bits(o[dt][2 * row] * inv, o[dt][2 * row + 1] * inv);
  }
#elif defined(__CUDA_ARCH__)
  __trap();  // tensor-core bf16 needs sm_80; builds target 80 and up
#endif
}

template <KvDtype C>
Status launch_attention_tiles(const AttentionArgs& a, const PagedKvPool& kv, cudaStream_t stream) {
  const int group = a.n_heads / kv.n_kv;
  const int hb = group % 4 == 0 ? 4 : group % 2 == 0 ? 2 : 1;
  const int rows = kQueryTile * (kPromptWarps / hb);
  const dim3 grid((a.tokens + rows - 1) / rows, a.n_heads / hb), block(kPromptThreads);
  switch (kv.head_dim) {
    case 32: MOE_CUDA_TRY(detail::launch_pdl(attention_tiles_kernel<32, C>, grid, block, 0, stream, a, kv, hb)); break;
    case 64: MOE_CUDA_TRY(detail::launch_pdl(attention_tiles_kernel<64, C>, grid, block, 0, stream, a, kv, hb)); break;
    case 128: MOE_CUDA_TRY(detail::launch_pdl(attention_tiles_kernel<128, C>, grid, block, 0, stream, a, kv, hb)); break;
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
