// One block of 1024 threads per row. Token adjustments: one block per row,
// its threads over the row's entries (distinct tokens: no two write one
// logit). Top-k / top-p: a 4-pass radix select
// (8 bits a pass) finds the C-th largest logit, the tokens at or above it are
// gathered, bitonic-sorted (logit desc, id asc), and the draw runs over them
// in f64 like the CPU twin.
#include <climits>

#include "kernels/cuda/cuda_check.cuh"
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/device_math.cuh"
#include "kernels/cuda/sampling.cuh"

namespace moe::cuda {
namespace {

constexpr int kThreads = 1024;
constexpr int kList = 2 * kMaxCandidates;  // room for ties at the threshold

__device__ __forceinline__ uint64_t splitmix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

__device__ __forceinline__ double uniform(uint64_t seed, int64_t position) {
  const uint64_t h = splitmix64(splitmix64(seed) ^ uint64_t(position) * 0xD6E8FEB86659FD93ull);
  return double(h >> 11) * (1.0 / 9007199254740992.0);
}

// Order-preserving map of a float to an unsigned key.
__device__ __forceinline__ uint32_t key_of(float f) {
  const uint32_t u = __float_as_uint(f);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

struct Best {
  float v;
  int i;
};
__device__ __forceinline__ Best better(Best a, Best b) {
  return (b.v > a.v || (b.v == a.v && b.i < a.i)) ? b : a;
}

// A row as the draw sees it: a token the row's mask leaves out reads -inf
// (the logits themselves stay, for raw log probabilities).
struct MaskedRow {
  const float* row;
  const uint32_t* mask;  // null: every token
  __device__ __forceinline__ float operator[](int i) const {
    return mask && !((mask[i >> 5] >> (i & 31)) & 1u) ? -INFINITY : row[i];
  }
};

// Block arg-max (lowest index among equals); result valid in every thread.
template <typename Row>
__device__ Best block_argmax(const Row& row, int vocab, Best* scratch) {
  Best b{-INFINITY, INT_MAX};
  for (int i = threadIdx.x; i < vocab; i += blockDim.x) b = better(b, Best{row[i], i});
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    Best x{__shfl_xor_sync(0xffffffffu, b.v, o), __shfl_xor_sync(0xffffffffu, b.i, o)};
    b = better(b, x);
  }
  if ((threadIdx.x & 31) == 0) scratch[threadIdx.x >> 5] = b;
  __syncthreads();
  Best r{-INFINITY, INT_MAX};
  for (int w = 0; w < int(blockDim.x >> 5); ++w) r = better(r, scratch[w]);
  __syncthreads();
  return r;
}

// Block sum of one int per thread, through `scratch` ([blockDim.x] doubles);
// the result in every thread.
__device__ int block_sum(int v, double* scratch) {
  scratch[threadIdx.x] = double(v);
  __syncthreads();
  for (int o = int(blockDim.x) / 2; o > 0; o >>= 1) {
    if (int(threadIdx.x) < o) scratch[threadIdx.x] += scratch[threadIdx.x + o];
    __syncthreads();
  }
  const int total = int(scratch[0]);
  __syncthreads();
  return total;
}

__global__ void __launch_bounds__(kThreads) argmax_kernel(const float* logits, int vocab, int32_t* tokens) {
  detail::allow_next_grid();
  detail::wait_prior_grid();
  __shared__ Best scratch[kThreads / 32];
  const Best b = block_argmax(logits + size_t(blockIdx.x) * vocab, vocab, scratch);
  if (threadIdx.x == 0) tokens[blockIdx.x] = b.i;
}

__global__ void __launch_bounds__(kThreads)
    sample_kernel(const float* logits, int vocab, const SampleDraw* params, const int64_t* positions,
                  int32_t* tokens, const AdjustSpan* spans, const uint32_t* masks) {
  detail::allow_next_grid();
  detail::wait_prior_grid();
  __shared__ Best scratch[kThreads / 32];
  __shared__ unsigned long long list[kList];  // (key << 32) | (~id): sorts desc by key, asc by id
  __shared__ double prob[kMaxCandidates];
  __shared__ unsigned hist[256];
  __shared__ unsigned s_prefix, s_mask, s_remaining, s_count;
  __shared__ double seg[kThreads];
  const uint32_t mask_at = spans ? spans[blockIdx.x].mask : kNoMask;
  const MaskedRow row{logits + size_t(blockIdx.x) * vocab, mask_at == kNoMask ? nullptr : masks + mask_at};
  const SampleDraw p = params[blockIdx.x];
  const Best top = block_argmax(row, vocab, scratch);
  // An infinite best (an overflowed penalty or bias) leaves no finite
  // weights: the best token, as greedy (the CPU twin does the same).
  if (p.temperature <= 0.f || p.top_k == 1 || isinf(top.v)) {
    if (threadIdx.x == 0) tokens[blockIdx.x] = top.i;
    return;
  }
  const double inv_t = 1.0 / double(p.temperature);
  const double mx = top.v;
  // A token's unnormalised probability after temperature; min_p drops what
  // is below min_p x the best token's (whose term is 1).
  const double cut = double(p.min_p);
  auto weight = [inv_t, mx, cut](float l) {
    const double e = exp((double(l) - mx) * inv_t);
    return e < cut ? 0.0 : e;
  };
  const double u = uniform(p.seed, positions[blockIdx.x]);
  const bool limit_k = p.top_k > 0 && p.top_k < vocab;
  const bool limit_p = p.top_p < 1.f;

  if (!limit_k && !limit_p) {
    // Whole vocabulary in id order: each thread owns a contiguous segment.
    const int per = (vocab + kThreads - 1) / kThreads;
    const int b0 = threadIdx.x * per, b1 = min(vocab, b0 + per);
    double s = 0.0;
    for (int i = b0; i < b1; ++i) s += weight(row[i]);
    seg[threadIdx.x] = s;
    __syncthreads();
    if (threadIdx.x == 0) {
      double total = 0.0;
      for (int i = 0; i < kThreads; ++i) {
        const double v = seg[i];
        seg[i] = total;  // exclusive prefix
        total += v;
      }
      prob[0] = u * total;
      tokens[blockIdx.x] = top.i;  // rounding left the target past the end
    }
    __syncthreads();
    const double target = prob[0];
    double acc = seg[threadIdx.x];
    const double next = threadIdx.x + 1 < kThreads ? seg[threadIdx.x + 1] : INFINITY;
    if (b0 < b1 && acc <= target && target < next) {
      int pick = top.i;
      for (int i = b0; i < b1; ++i) {
        const double w = weight(row[i]);
        acc += w;
        if (w > 0.0) pick = i;  // rounding may end the segment short of the target: its last drawable token
        if (acc > target) break;
      }
      tokens[blockIdx.x] = pick;
    }
    return;
  }

  // Candidates are drawable tokens only: a masked or banned one (-inf) never
  // takes a place (a mask of five tokens under top_k 40 keeps five). Only a
  // row with a mask or adjustments (bans) can hold -inf: the others skip the count.
  int drawable = vocab;
  if (row.mask || (spans && spans[blockIdx.x].count > 0)) {
    int finite = 0;
    for (int i = threadIdx.x; i < vocab; i += kThreads) finite += row[i] > -INFINITY ? 1 : 0;
    drawable = max(block_sum(finite, seg), 1);
  }
  const int C = min(min(min(limit_k ? p.top_k : kMaxCandidates, kMaxCandidates), vocab), drawable);
  if (threadIdx.x == 0) {
    s_prefix = 0;
    s_mask = 0;
    s_remaining = C;
    s_count = 0;
  }
  for (int shift = 24; shift >= 0; shift -= 8) {
    for (int i = threadIdx.x; i < 256; i += kThreads) hist[i] = 0;
    __syncthreads();
    const unsigned prefix = s_prefix, mask = s_mask;
    for (int i = threadIdx.x; i < vocab; i += kThreads) {
      const uint32_t k = key_of(row[i]);
      if ((k & mask) == prefix) atomicAdd(&hist[(k >> shift) & 255u], 1u);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      unsigned cum = 0, rem = s_remaining;
      for (int d = 255; d >= 0; --d) {
        if (cum + hist[d] >= rem) {
          s_prefix = prefix | (unsigned(d) << shift);
          s_remaining = rem - cum;
          break;
        }
        cum += hist[d];
      }
      s_mask = mask | (255u << shift);
    }
    __syncthreads();
  }
  const uint32_t thr = s_prefix;
  for (int i = threadIdx.x; i < vocab; i += kThreads) {
    const uint32_t k = key_of(row[i]);
    if (k >= thr) {
      const unsigned at = atomicAdd(&s_count, 1u);
      if (at < unsigned(kList)) list[at] = (static_cast<unsigned long long>(k) << 32) | (~uint32_t(i));
    }
  }
  __syncthreads();
  const int n = min(int(s_count), kList);
  for (int i = n + threadIdx.x; i < kList; i += kThreads) list[i] = 0ull;
  __syncthreads();
  for (int k = 2; k <= kList; k <<= 1) {
    for (int j = k >> 1; j > 0; j >>= 1) {
      for (int i = threadIdx.x; i < kList; i += kThreads) {
        const int x = i ^ j;
        if (x > i) {
          const unsigned long long a = list[i], b = list[x];
          const bool desc = (i & k) == 0;
          if (desc ? (a < b) : (a > b)) {
            list[i] = b;
            list[x] = a;
          }
        }
      }
      __syncthreads();
    }
  }
  for (int i = threadIdx.x; i < C; i += kThreads)
    prob[i] = weight(row[~uint32_t(list[i] & 0xffffffffull)]);
  if (limit_p && !limit_k) {
    // top-p alone: the threshold is top_p of the whole vocabulary's mass,
    // as on the CPU, even though only the candidates can be kept.
    double s = 0.0;
    for (int i = threadIdx.x; i < vocab; i += kThreads) s += weight(row[i]);
    seg[threadIdx.x] = s;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    int keep = C;
    if (limit_p) {
      double total = 0.0;
      if (limit_k) {
        for (int i = 0; i < keep; ++i) total += prob[i];
      } else {
        for (int i = 0; i < kThreads; ++i) total += seg[i];
      }
      double acc = 0.0;
      int m = 0;
      while (m < keep) {
        acc += prob[m++];
        if (acc >= double(p.top_p) * total) break;
      }
      keep = m;
    }
    double total = 0.0;
    for (int i = 0; i < keep; ++i) total += prob[i];
    const double target = u * total;
    double acc = 0.0;
    int pick = 0;  // rounding left the target past the kept mass: the best
    for (int i = 0; i < keep; ++i) {
      acc += prob[i];
      if (acc > target) {
        pick = i;
        break;
      }
    }
    tokens[blockIdx.x] = int32_t(~uint32_t(list[pick] & 0xffffffffull));
  }
}

__global__ void adjust_kernel(float* logits, int vocab, const AdjustSpan* spans, const TokenAdjust* entries,
                              float* saved) {
  detail::allow_next_grid();
  detail::wait_prior_grid();
  const AdjustSpan sp = spans[blockIdx.x];
  float* row = logits + size_t(blockIdx.x) * vocab;
  for (uint32_t e = sp.first + threadIdx.x; e < sp.first + sp.count; e += blockDim.x) {
    const TokenAdjust a = entries[e];
    if (a.token < 0 || a.token >= vocab) continue;
    const float l = row[a.token];
    saved[e] = l;
    row[a.token] = adjusted_logit(l, a, sp.penalties);
  }
}

}  // namespace

Status adjust_logits(float* logits, int rows, int vocab, const AdjustSpan* spans, const TokenAdjust* entries,
                     float* saved, cudaStream_t stream) {
  MOE_CUDA_REQUIRE(logits && spans && entries && saved, "null pointer");
  MOE_CUDA_REQUIRE(rows > 0 && vocab > 0, "rows and vocab must be positive");
  MOE_CUDA_TRY(detail::launch_pdl(adjust_kernel, dim3(rows), dim3(256), 0, stream, logits, vocab, spans, entries, saved));
  MOE_CUDA_LAUNCHED();
  return {};
}

Status sample_tokens(const float* logits, int rows, int vocab, const SampleDraw* params,
                     const int64_t* positions, int32_t* tokens, cudaStream_t stream, const AdjustSpan* spans,
                     const uint32_t* masks) {
  MOE_CUDA_REQUIRE(logits && params && positions && tokens, "null pointer");
  MOE_CUDA_REQUIRE(rows > 0 && vocab > 0, "rows and vocab must be positive");
  MOE_CUDA_TRY(detail::launch_pdl(sample_kernel, dim3(rows), dim3(kThreads), 0, stream, logits, vocab, params, positions,
                                  tokens, spans, masks));
  MOE_CUDA_LAUNCHED();
  return {};
}

Status argmax_tokens(const float* logits, int rows, int vocab, int32_t* tokens, cudaStream_t stream) {
  MOE_CUDA_REQUIRE(logits && tokens && rows > 0 && vocab > 0, "null pointer or empty");
  MOE_CUDA_TRY(detail::launch_pdl(argmax_kernel, dim3(rows), dim3(kThreads), 0, stream, logits, vocab, tokens));
  MOE_CUDA_LAUNCHED();
  return {};
}

}  // namespace moe::cuda
