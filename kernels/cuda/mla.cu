// Multi-head latent attention, absorbed (kernels/cuda/mla.cuh).
//
// mla_rope_store: a block per token. head_gemv: a warp per output row, its
// weights in registers, over a tile of 16 tokens. mla_attention: a block per
// (query token, 1 or 4 heads), 8 warps over tiles of 32 keys; scores with a lane per
// key dotting the whole latent row (16-byte loads) with the scaled query in
// shared memory, values with lanes owning latent dims and each key's
// probability broadcast; online-softmax state per warp, merged through
// shared memory at the end (the shape of paged_attention). Decode passes
// split a (token, head)'s keys over several blocks, merged by a second
// kernel (mla_merge_kernel).
#include "kernels/cuda/cuda_check.cuh"
#include "kernels/cuda/device_math.cuh"
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/mla.cuh"

namespace moe::cuda {
namespace {

using bf16 = __nv_bfloat16;
constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;

__device__ __forceinline__ int64_t block_stride_of(const PagedLatentPool& p) {
  return p.block_stride ? p.block_stride : int64_t(p.block_tokens) * (p.rank + p.rope);
}

__global__ void __launch_bounds__(kThreads) mla_rope_kernel(MlaRopeArgs a, PagedLatentPool p) {
  detail::allow_next_grid();
  detail::wait_prior_grid();
  __shared__ float red[kWarps];
  const int t = blockIdx.x;
  const int R = p.rank, P = p.rope, W = R + P, qk = a.nope + P;
  const float* row = a.proj + size_t(t) * a.row_stride;
  const float* kva = row + size_t(a.n_heads) * qk;
  const int pos = a.positions[t];
  const int32_t* table = p.block_tables + size_t(a.seq_of_token[t]) * p.max_blocks;
  bf16* dst = p.rows + int64_t(table[pos / p.block_tokens]) * block_stride_of(p) + int64_t(pos % p.block_tokens) * W;
  // The latent: RMSNorm of kv_a's first rank values.
  float ss = 0.f;
  for (int i = threadIdx.x; i < R; i += blockDim.x) ss += kva[i] * kva[i];
  const float inv = rsqrtf(detail::block_sum(ss, red) / float(R) + a.eps);
  for (int i = threadIdx.x; i < R; i += blockDim.x)
    dst[i] = __float2bfloat16(__bfloat162float(a.kv_a_norm[i]) * (kva[i] * inv));
  // The shared key's pairs, then every head's query.
  auto rotate = [&](int i, float x0, float x1, bf16* out) {
    float sn, cs;
    sincosf(float(pos) * a.inv_freq[i], &sn, &cs);
    cs *= a.attention_factor;
    sn *= a.attention_factor;
    out[2 * i] = __float2bfloat16(x0 * cs - x1 * sn);
    out[2 * i + 1] = __float2bfloat16(x1 * cs + x0 * sn);
  };
  for (int i = threadIdx.x; i < P / 2; i += blockDim.x) rotate(i, kva[R + 2 * i], kva[R + 2 * i + 1], dst + R);
  const int per_head = a.nope + P / 2;  // a thread per no-RoPE value or RoPE pair
  for (int idx = threadIdx.x; idx < a.n_heads * per_head; idx += blockDim.x) {
    const int h = idx / per_head, e = idx % per_head;
    const float* qh = row + size_t(h) * qk;
    if (e < a.nope) {
      a.q_nope[(size_t(t) * a.n_heads + h) * a.nope + e] = __float2bfloat16(qh[e]);
    } else {
      const int i = e - a.nope;
      rotate(i, qh[a.nope + 2 * i], qh[a.nope + 2 * i + 1], a.q_abs + (size_t(t) * a.n_heads + h) * W + R);
    }
  }
}

constexpr int kHeadTokTile = 16;
constexpr int kHeadMaxPairs = 16;  // cols <= 32 lanes * 16 pairs * 2

__global__ void __launch_bounds__(kThreads) head_gemv_kernel(HeadGemvArgs a) {
  detail::allow_next_grid();
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int r = blockIdx.x * kWarps + warp, g = blockIdx.y, t0 = blockIdx.z * kHeadTokTile;
  // The row's weights before the wait: nothing writes them.
  float2 w[kHeadMaxPairs];
  const bool live = r < a.rows;
  const bf16* wr = a.w + (size_t(g) * a.rows + (live ? r : 0)) * a.cols;
#pragma unroll
  for (int k = 0; k < kHeadMaxPairs; ++k) {
    const int c = (lane + 32 * k) * 2;
    w[k] = live && c < a.cols ? __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(wr + c)) : float2{0.f, 0.f};
  }
  detail::wait_prior_grid();
  if (!live) return;
  const int t_end = min(a.tokens, t0 + kHeadTokTile);
  for (int t = t0; t < t_end; ++t) {
    const bf16* xr = a.x + t * a.x_token_stride + g * a.x_group_stride;
    float acc = 0.f;
#pragma unroll
    for (int k = 0; k < kHeadMaxPairs; ++k) {
      const int c = (lane + 32 * k) * 2;
      if (c < a.cols) {
        const float2 x = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(xr + c));
        acc = fmaf(w[k].x, x.x, fmaf(w[k].y, x.y, acc));
      }
    }
    acc = detail::warp_sum(acc);
    if (lane == 0) a.out[t * a.out_token_stride + g * a.out_group_stride + r] = __float2bfloat16(acc);
  }
}

// D consecutive bf16 of a latent row as floats (D = 1 or a multiple of 8).
template <int D>
__device__ __forceinline__ void load_latent(const bf16* p, float* out) {
  if constexpr (D % 8 == 0) {
#pragma unroll
    for (int c = 0; c < D / 8; ++c) detail::load_row_part<8>(p + c * 8, out + c * 8);
  } else {
#pragma unroll
    for (int i = 0; i < D; ++i) out[i] = __bfloat162float(p[i]);
  }
}

// HPB heads of one token a block: each latent row is loaded once for all
// of them (prefill passes take 4; decode passes 1, for more blocks).
template <int R, int P, int HPB>
__global__ void __launch_bounds__(kThreads) mla_attention_kernel(MlaAttentionArgs a, PagedLatentPool p) {
  detail::allow_next_grid();
  detail::wait_prior_grid();
  constexpr int W = R + P;
  static_assert(W % 8 == 0 && R % 32 == 0, "latent rows are whole 16-byte runs, rank a multiple of 32");
  constexpr int D = R / 32;  // latent dims a lane owns in the value phase
  static_assert(D == 1 || D % 8 == 0, "rank 32 or a multiple of 256");
  __shared__ float qs[HPB][W];
  __shared__ float wm[kWarps][HPB], wl[kWarps][HPB];
  __shared__ float wo[kWarps][R];
  const int t = blockIdx.x, h0 = blockIdx.y * HPB;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const bf16* q = a.q_abs + (size_t(t) * a.n_heads + h0) * W;
  for (int i = threadIdx.x; i < HPB * W; i += kThreads) qs[i / W][i % W] = __bfloat162float(q[i]) * a.scale;
  __syncthreads();
  const int total_keys = a.positions[t] + 1;
  const int32_t* table = p.block_tables + size_t(a.seq_of_token[t]) * p.max_blocks;
  const int64_t bstride = block_stride_of(p);
  // This block's keys: split blockIdx.z's run of whole tiles.
  const int split = blockIdx.z;
  const int per_split = (total_keys + a.splits - 1) / a.splits;
  const int first_tile = split * ((per_split + 31) / 32);
  const int n_keys = min(total_keys, (first_tile + (per_split + 31) / 32) * 32);
  // Head hh's state of this split (splits > 1).
  auto part_of = [&](int hh) {
    return a.partials + ((size_t(t) * a.n_heads + h0 + hh) * a.splits + split) * (R + 2);
  };
  if (first_tile * 32 >= total_keys) {  // an empty split: nothing to merge
    for (int i = threadIdx.x; i < HPB * (R + 2); i += kThreads) part_of(i / (R + 2))[i % (R + 2)] = i % (R + 2) == 0 ? -INFINITY : 0.f;
    return;
  }

  float m[HPB], l[HPB], o[HPB][D];
#pragma unroll
  for (int hh = 0; hh < HPB; ++hh) {
    m[hh] = -INFINITY;
    l[hh] = 0.f;
#pragma unroll
    for (int i = 0; i < D; ++i) o[hh][i] = 0.f;
  }

  for (int tile = first_tile + warp; tile * 32 < n_keys; tile += kWarps) {
    const int j = tile * 32 + lane;
    float s[HPB];
#pragma unroll
    for (int hh = 0; hh < HPB; ++hh) s[hh] = -INFINITY;
    long long slot = 0;  // this lane's key's row
    if (j < n_keys) {
      slot = (long long)table[j / p.block_tokens] * bstride + (long long)(j % p.block_tokens) * W;
      const uint4* kr = reinterpret_cast<const uint4*>(p.rows + slot);
      float d[HPB];
#pragma unroll
      for (int hh = 0; hh < HPB; ++hh) d[hh] = 0.f;
#pragma unroll 4
      for (int c = 0; c < W / 8; ++c) {
        const uint4 u = __ldg(kr + c);
        const __nv_bfloat162* b = reinterpret_cast<const __nv_bfloat162*>(&u);
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const float2 f = __bfloat1622float2(b[e]);
#pragma unroll
          for (int hh = 0; hh < HPB; ++hh) {
            d[hh] = fmaf(f.x, qs[hh][c * 8 + 2 * e], d[hh]);
            d[hh] = fmaf(f.y, qs[hh][c * 8 + 2 * e + 1], d[hh]);
          }
        }
      }
#pragma unroll
      for (int hh = 0; hh < HPB; ++hh) s[hh] = d[hh];
    }
    float pj[HPB];
#pragma unroll
    for (int hh = 0; hh < HPB; ++hh) {
      const float m_new = fmaxf(m[hh], detail::warp_max(s[hh]));  // finite: the tile's first key is always in range
      const float corr = __expf(m[hh] - m_new);
      pj[hh] = j < n_keys ? __expf(s[hh] - m_new) : 0.f;
      l[hh] = l[hh] * corr + detail::warp_sum(pj[hh]);
#pragma unroll
      for (int i = 0; i < D; ++i) o[hh][i] *= corr;
      m[hh] = m_new;
    }
    const int in_tile = min(32, n_keys - tile * 32);
    for (int k = 0; k < in_tile; ++k) {
      const long long sk = __shfl_sync(0xffffffffu, slot, k);
      float v[D];
      load_latent<D>(p.rows + sk + lane * D, v);
#pragma unroll
      for (int hh = 0; hh < HPB; ++hh) {
        const float pk = __shfl_sync(0xffffffffu, pj[hh], k);
#pragma unroll
        for (int i = 0; i < D; ++i) o[hh][i] = fmaf(pk, v[i], o[hh][i]);
      }
    }
  }
  if (lane == 0)
#pragma unroll
    for (int hh = 0; hh < HPB; ++hh) {
      wm[warp][hh] = m[hh];
      wl[warp][hh] = l[hh];
    }
  // The warps' states merged head by head through wo.
#pragma unroll
  for (int hh = 0; hh < HPB; ++hh) {
    __syncthreads();  // wm / wl written; wo free again
#pragma unroll
    for (int i = 0; i < D; ++i) wo[warp][lane * D + i] = o[hh][i];
    __syncthreads();
    float mx = -INFINITY;
    for (int w = 0; w < kWarps; ++w) mx = fmaxf(mx, wm[w][hh]);
    float sum = 0.f;
    for (int w = 0; w < kWarps; ++w) sum += wl[w][hh] * __expf(wm[w][hh] - mx);
    if (a.splits > 1) {  // the split's state, unnormalised, for mla_merge_kernel
      float* part = part_of(hh);
      for (int c = threadIdx.x; c < R; c += kThreads) {
        float v = 0.f;
        for (int w = 0; w < kWarps; ++w) v += wo[w][c] * __expf(wm[w][hh] - mx);
        part[2 + c] = v;
      }
      if (threadIdx.x == 0) {
        part[0] = mx;
        part[1] = sum;
      }
    } else {
      const float inv = 1.f / sum;
      bf16* out = a.out + (size_t(t) * a.n_heads + h0 + hh) * R;
      for (int c = threadIdx.x; c < R; c += kThreads) {
        float v = 0.f;
        for (int w = 0; w < kWarps; ++w) v += wo[w][c] * __expf(wm[w][hh] - mx);
        out[c] = __float2bfloat16(v * inv);
      }
    }
  }
}

// A block per (token, head): its splits' states into the output.
__global__ void __launch_bounds__(kThreads) mla_merge_kernel(MlaAttentionArgs a, int R) {
  detail::allow_next_grid();
  detail::wait_prior_grid();
  const int t = blockIdx.x, h = blockIdx.y, S = a.splits;
  const float* part = a.partials + (size_t(t) * a.n_heads + h) * S * (R + 2);
  float mx = -INFINITY;
  for (int s = 0; s < S; ++s) mx = fmaxf(mx, part[size_t(s) * (R + 2)]);
  float w[kMlaMaxSplits];
  float sum = 0.f;
  for (int s = 0; s < S; ++s) {
    w[s] = __expf(part[size_t(s) * (R + 2)] - mx);  // 0 for an empty split
    sum += part[size_t(s) * (R + 2) + 1] * w[s];
  }
  const float inv = 1.f / sum;
  bf16* out = a.out + (size_t(t) * a.n_heads + h) * R;
  for (int c = threadIdx.x; c < R; c += kThreads) {
    float v = 0.f;
    for (int s = 0; s < S; ++s) v += part[size_t(s) * (R + 2) + 2 + c] * w[s];
    out[c] = __float2bfloat16(v * inv);
  }
}

}  // namespace

bool mla_shape_supported(int rank, int rope) { return (rank == 512 && rope == 64) || (rank == 32 && rope == 8); }

Status mla_rope_store(const MlaRopeArgs& a, const PagedLatentPool& p, cudaStream_t stream) {
  MOE_CUDA_REQUIRE(a.proj && a.kv_a_norm && a.positions && a.seq_of_token && a.inv_freq && a.q_nope && a.q_abs &&
                       p.rows && p.block_tables,
                   "null pointer");
  MOE_CUDA_REQUIRE(a.tokens > 0 && a.n_heads > 0 && a.nope > 0 && p.rank > 0 && p.rope > 0 && p.rope % 2 == 0,
                   "tokens, heads and widths must be positive, the RoPE width even");
  MOE_CUDA_REQUIRE(a.row_stride >= a.n_heads * (a.nope + p.rope) + p.rank + p.rope, "row_stride too small");
  MOE_CUDA_TRY(detail::launch_pdl(mla_rope_kernel, dim3(a.tokens), dim3(kThreads), 0, stream, a, p));
  MOE_CUDA_LAUNCHED();
  return {};
}

Status head_gemv(const HeadGemvArgs& a, cudaStream_t stream) {
  MOE_CUDA_REQUIRE(a.w && a.x && a.out, "null pointer");
  MOE_CUDA_REQUIRE(a.groups > 0 && a.rows > 0 && a.tokens > 0, "groups, rows and tokens must be positive");
  MOE_CUDA_REQUIRE(a.cols > 0 && a.cols % 2 == 0 && a.cols <= 64 * kHeadMaxPairs, "cols must be even and at most 1024");
  MOE_CUDA_REQUIRE(a.x_token_stride % 2 == 0 && a.x_group_stride % 2 == 0, "input strides must be even");
  const dim3 grid((a.rows + kWarps - 1) / kWarps, a.groups, (a.tokens + kHeadTokTile - 1) / kHeadTokTile);
  MOE_CUDA_TRY(detail::launch_pdl(head_gemv_kernel, grid, dim3(kThreads), 0, stream, a));
  MOE_CUDA_LAUNCHED();
  return {};
}

Status mla_attention(const MlaAttentionArgs& a, const PagedLatentPool& p, cudaStream_t stream) {
  MOE_CUDA_REQUIRE(a.q_abs && a.seq_of_token && a.positions && a.out && p.rows && p.block_tables, "null pointer");
  MOE_CUDA_REQUIRE(a.tokens > 0 && a.n_heads > 0, "tokens and heads must be positive");
  MOE_CUDA_REQUIRE(a.splits >= 1 && a.splits <= kMlaMaxSplits && (a.splits == 1 || a.partials),
                   "splits must be in [1, 16], with partials above 1");
  const int hpb = mla_heads_per_block(a.tokens, a.n_heads);
  const dim3 grid(a.tokens, a.n_heads / hpb, a.splits);
  auto go = [&](auto kernel) { return detail::launch_pdl(kernel, grid, dim3(kThreads), 0, stream, a, p); };
  if (p.rank == 512 && p.rope == 64) {
    MOE_CUDA_TRY(hpb == 4 ? go(mla_attention_kernel<512, 64, 4>) : go(mla_attention_kernel<512, 64, 1>));
  } else if (p.rank == 32 && p.rope == 8) {
    MOE_CUDA_TRY(hpb == 4 ? go(mla_attention_kernel<32, 8, 4>) : go(mla_attention_kernel<32, 8, 1>));
  } else {
    return make_error("mla_attention is compiled for (kv_lora_rank, qk_rope_head_dim) (512, 64) and (32, 8), not (" +
                      std::to_string(p.rank) + ", " + std::to_string(p.rope) + ")");
  }
  MOE_CUDA_LAUNCHED();
  if (a.splits > 1) {
    MOE_CUDA_TRY(detail::launch_pdl(mla_merge_kernel, dim3(a.tokens, a.n_heads), dim3(kThreads), 0, stream, a, p.rank));
    MOE_CUDA_LAUNCHED();
  }
  return {};
}

}  // namespace moe::cuda
