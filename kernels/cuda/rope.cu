// A block per (token, 8 heads), a warp per head (q heads, then k heads, then v).
// The full-width q/k norm needs the sum of squares of a token's whole q (or
// k) row: each block that holds a q (k) head sums it first, all threads
// together, so the heads of one token need no communication between blocks.
#include <cuda_fp8.h>

#include "kernels/cuda/cuda_check.cuh"
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/device_math.cuh"
#include "kernels/cuda/rope.cuh"

namespace moe::cuda {
namespace {

constexpr int kThreads = 256;

__global__ void __launch_bounds__(kThreads) qkv_rope_kernel(QkvRopeArgs a, PagedKvPool kv) {
  detail::allow_next_grid();
  detail::wait_prior_grid();
  extern __shared__ float sh[];  // one head_dim row per warp
  const int t = blockIdx.x;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  const int first_head = blockIdx.y * nw;  // a block covers nw heads of one token
  const int HD = kv.head_dim, half = HD / 2;
  const int n_total = a.n_heads + 2 * kv.n_kv;
  const int pos = a.positions[t];
  const float* row = a.qkv + size_t(t) * n_total * HD;
  const int32_t* table = kv.block_tables + size_t(a.seq_of_token[t]) * kv.max_blocks;
  // The token's slot: its block's rows, then the slot within (block strides
  // as PagedKvPool says; negative where blocks run down).
  const int64_t blk = table[pos / kv.block_tokens], in_blk = pos % kv.block_tokens;
  const int64_t row_stride = int64_t(kv.n_kv) * HD;
  const int64_t slot = blk * kv.block_elems() + in_blk * row_stride;
  const int64_t scale_slot = blk * kv.block_scales() + in_blk * kv.n_kv;
  float* x = sh + warp * HD;
  // Full-width norm: 1 / rms of the token's q and k rows (bias included).
  float inv_q = 0.f, inv_k = 0.f;
  if (a.qk_norm_full_width) {
    const int q_width = a.n_heads * HD, k_width = kv.n_kv * HD;
    const bool need_q = a.q_norm && first_head < a.n_heads;
    const bool need_k = a.k_norm && first_head < a.n_heads + kv.n_kv && first_head + nw > a.n_heads;
    if (need_q || need_k) {  // the same for the whole block
      __shared__ float red[2][kThreads / 32];
      float sq = 0.f, sk = 0.f;
      if (need_q)
        for (int i = threadIdx.x; i < q_width; i += blockDim.x) {
          float v = row[i];
          if (a.bias) v += __bfloat162float(a.bias[i]);
          sq += v * v;
        }
      if (need_k)
        for (int i = threadIdx.x; i < k_width; i += blockDim.x) {
          float v = row[q_width + i];
          if (a.bias) v += __bfloat162float(a.bias[q_width + i]);
          sk += v * v;
        }
      sq = detail::warp_sum(sq);
      sk = detail::warp_sum(sk);
      if (lane == 0) {
        red[0][warp] = sq;
        red[1][warp] = sk;
      }
      __syncthreads();
      sq = sk = 0.f;
      for (int w = 0; w < nw; ++w) {
        sq += red[0][w];
        sk += red[1][w];
      }
      inv_q = rsqrtf(sq / float(q_width) + a.eps);
      inv_k = rsqrtf(sk / float(k_width) + a.eps);
    }
  }
  for (int head = first_head + warp; head < n_total && head < first_head + nw; head += nw) {
    const bool is_q = head < a.n_heads, is_k = !is_q && head < a.n_heads + kv.n_kv;
    float ss = 0.f;
    for (int i = lane; i < HD; i += 32) {
      float v = row[size_t(head) * HD + i];
      if (a.bias) v += __bfloat162float(a.bias[size_t(head) * HD + i]);
      x[i] = v;
      ss += v * v;
    }
    const __nv_bfloat16* nw_ = is_q ? a.q_norm : (is_k ? a.k_norm : nullptr);
    __syncwarp();
    if (nw_ && a.qk_norm_full_width) {
      const float inv = is_q ? inv_q : inv_k;
      const __nv_bfloat16* w = nw_ + size_t(is_q ? head : head - a.n_heads) * HD;
      for (int i = lane; i < HD; i += 32) x[i] = __bfloat162float(w[i]) * (x[i] * inv);
      __syncwarp();
    } else if (nw_) {
      const float inv = rsqrtf(detail::warp_sum(ss) / float(HD) + a.eps);
      for (int i = lane; i < HD; i += 32) x[i] = __bfloat162float(nw_[i]) * (x[i] * inv);
      __syncwarp();
    }
    if (is_q || is_k) {
      for (int i = lane; i < half; i += 32) {
        float sn, cs;
        sincosf(float(pos) * a.inv_freq[i], &sn, &cs);
        cs *= a.attention_factor;
        sn *= a.attention_factor;
        const float x0 = x[i], x1 = x[i + half];
        x[i] = x0 * cs - x1 * sn;
        x[i + half] = x1 * cs + x0 * sn;
      }
      __syncwarp();
    }
    const int kvh = is_k ? head - a.n_heads : head - a.n_heads - kv.n_kv;
    const int64_t row = slot + int64_t(kvh) * HD;  // the row's first element
    const int64_t srow = scale_slot + kvh;         // its scale
    if (!is_q && kv.dtype != KvDtype::bf16) {
      // A coded row (kernels/kv_code.h's kv_encode_row): one scale from the
      // row's max |x|, the codes of x * (code max / max |x|), IEEE-rounded.
      float amax = 0.f;
      for (int i = lane; i < HD; i += 32) amax = fmaxf(amax, fabsf(x[i]));
      amax = detail::warp_max(amax);
      const bool fp8 = kv.dtype == KvDtype::fp8;
      const float cmax = fp8 ? 448.f : 127.f;
      // A row too small for its inverse to stay finite is stored as zeros.
      const bool tiny = !(amax > __fdiv_rn(cmax, 3.402823466e38f));
      const float inv = tiny ? 0.f : __fdiv_rn(cmax, amax);
      if (tiny) amax = 0.f;
      uint8_t* codes = (is_k ? kv.k_codes : kv.v_codes) + row;
      for (int i = lane; i < HD; i += 32) {
        const float y = __fmul_rn(x[i], inv);
        codes[i] = fp8 ? uint8_t(__nv_cvt_float_to_fp8(y, __NV_SATFINITE, __NV_E4M3))
                       : uint8_t(int8_t(max(-127, min(127, __float2int_rn(y)))));
      }
      if (lane == 0) (is_k ? kv.k_scales : kv.v_scales)[srow] = __fdiv_rn(amax, cmax);
    } else {
      __nv_bfloat16* dst;
      if (is_q) dst = a.q_out + (size_t(t) * a.n_heads + head) * HD;
      else dst = (is_k ? kv.k : kv.v) + row;
      for (int i = lane; i < HD; i += 32) dst[i] = __float2bfloat16(x[i]);
    }
    __syncwarp();
  }
}

}  // namespace

Status qkv_rope_store(const QkvRopeArgs& a, const PagedKvPool& kv, cudaStream_t stream) {
  MOE_CUDA_REQUIRE(a.qkv && a.positions && a.seq_of_token && a.inv_freq && a.q_out, "null pointer");
  MOE_CUDA_REQUIRE(kv.block_tables && (kv_coded(kv.dtype) ? (kv.k_codes && kv.v_codes && kv.k_scales && kv.v_scales)
                                                            : (kv.k && kv.v)),
                   "null pool pointer");
  MOE_CUDA_REQUIRE(a.tokens > 0 && a.n_heads > 0 && kv.n_kv > 0, "tokens and heads must be positive");
  MOE_CUDA_REQUIRE(kv.head_dim > 0 && kv.head_dim % 2 == 0, "head_dim must be even");
  const size_t smem = size_t(kThreads / 32) * kv.head_dim * sizeof(float);
  const int heads = a.n_heads + 2 * kv.n_kv;
  const dim3 grid(a.tokens, (heads + kThreads / 32 - 1) / (kThreads / 32));
  MOE_CUDA_TRY(detail::launch_pdl(qkv_rope_kernel, grid, dim3(kThreads), smem, stream, a, kv));
  MOE_CUDA_LAUNCHED();
  return {};
}

}  // namespace moe::cuda
