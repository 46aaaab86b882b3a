// One warp per token; the row's probabilities sit in shared memory and the k
// winners come from k warp-wide arg-max rounds.
#include "kernels/cuda/cuda_check.cuh"
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/device_math.cuh"
#include "kernels/cuda/route_select.cuh"
#include "kernels/cuda/router.cuh"

namespace moe::cuda {
namespace {

constexpr int kWarps = 4;

using detail::draw_uniform;
using detail::mix64;
using detail::replay_row_of;

__global__ void router_kernel(const float* logits, int stride, int tokens, int n, int k, bool renorm,
                              float scale, int32_t* ids, float* weights, SharePublishArgs publish) {
  detail::allow_next_grid();
  detail::wait_prior_grid();
  extern __shared__ float sh[];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int t = blockIdx.x * kWarps + warp;
  if (t >= tokens) return;
  float* p = sh + warp * n;
  detail::select_top_k_warp(logits + size_t(t) * stride, n, k, renorm, scale, p, ids + size_t(t) * k,
                            weights + size_t(t) * k);
  if (publish.slot) {
    __syncwarp();  // the ids and weights above, written by other lanes
    share_publish_warp(publish, lane);
  }
}

// One thread per token. With a share to post the grid is one warp (at most
// kShareMaxTokens tokens), which then posts it from the drawn ids.
__global__ void force_experts_kernel(ForcedRouting route, int32_t* ids, int tokens, int n, int k,
                                     SharePublishArgs publish) {
  detail::allow_next_grid();
  detail::wait_prior_grid();  // the router's ids, which this overwrites
  const int t = blockIdx.x * blockDim.x + threadIdx.x;
  if (t < tokens) {
    int32_t* row = ids + size_t(t) * k;
    if (route.trace) {
      const int r = replay_row_of(route.seq_of_token[t], route.positions[t], route.trace_tokens);
      const int16_t* src = route.trace + (size_t(r) * route.trace_layers + route.layer) * k;
      for (int j = 0; j < k; ++j) row[j] = src[j];
    } else {
      draw_uniform(row, n, k, route.positions[t], route.seq_of_token[t], route.layer, route.seed);
    }
  }
  if (publish.slot) {
    __syncwarp();  // the drawn ids, written by other lanes
    share_publish_warp(publish, int(threadIdx.x));
  }
}

__global__ void force_guess_kernel(ForcedRouting route, float recall, int32_t* ids, int tokens, int n, int k) {
  const int t = blockIdx.x * blockDim.x + threadIdx.x;
  if (t >= tokens) return;
  const int r = replay_row_of(route.seq_of_token[t], route.positions[t], route.trace_tokens);
  const int16_t* src = route.trace + (size_t(r) * route.trace_layers + route.layer) * k;
  const uint64_t base = mix64(route.seed ^ mix64(uint64_t(route.layer) << 40 ^
                                                  uint64_t(uint32_t(route.positions[t])) << 8 ^ 0x9e55ull));
  for (int j = 0; j < k; ++j) {
    const uint64_t h = mix64(base + uint64_t(j));
    const bool keep = double(h >> 11) * 0x1.0p-53 < double(recall);
    ids[size_t(t) * k + j] = keep ? int32_t(src[j]) : int32_t(mix64(h) % uint64_t(n));
  }
}

}  // namespace

Status force_guess(const ForcedRouting& route, float recall, int32_t* ids, int tokens, int n_experts, int top_k,
                   cudaStream_t stream) {
  MOE_CUDA_REQUIRE(ids && route.positions && route.seq_of_token && route.trace, "null pointer (a trace is needed)");
  MOE_CUDA_REQUIRE(tokens > 0 && n_experts > 0 && top_k > 0 && route.trace_tokens > 0 && route.layer >= 0 &&
                       route.layer < route.trace_layers,
                   "tokens, experts, top_k and the trace's layer");
  force_guess_kernel<<<(tokens + 63) / 64, 64, 0, stream>>>(route, recall, ids, tokens, n_experts, top_k);
  MOE_CUDA_LAUNCHED();
  return {};
}

Status router_topk(const float* logits, int tokens, int n_experts, int top_k, bool renormalize, float scale,
                   int32_t* ids, float* weights, cudaStream_t stream, int logits_stride,
                   const SharePublishArgs* publish) {
  MOE_CUDA_REQUIRE(logits && ids && weights, "null pointer");
  MOE_CUDA_REQUIRE(tokens > 0 && n_experts > 0 && n_experts <= 1024, "n_experts must be in [1, 1024]");
  MOE_CUDA_REQUIRE(top_k > 0 && top_k <= n_experts, "top_k must be in [1, n_experts]");
  MOE_CUDA_REQUIRE(logits_stride == 0 || logits_stride >= n_experts, "logits_stride must be >= n_experts");
  MOE_CUDA_REQUIRE(!publish || (tokens == 1 && publish->tokens == 1 && publish->ids == ids &&
                                publish->route_w == weights && publish->top_k == top_k && top_k <= kShareMaxTopK &&
                                publish->slot),
                   "publish: one token, this call's ids and weights, top_k <= 16");
  const SharePublishArgs none;
  const size_t smem = size_t(kWarps) * n_experts * sizeof(float);
  MOE_CUDA_TRY(detail::launch_pdl(router_kernel, dim3((tokens + kWarps - 1) / kWarps), dim3(kWarps * 32), smem, stream, logits, logits_stride ? logits_stride : n_experts, tokens, n_experts, top_k, renormalize, scale, ids, weights, publish ? *publish : none));
  MOE_CUDA_LAUNCHED();
  return {};
}

Status force_experts(const ForcedRouting& route, int32_t* ids, int tokens, int n_experts, int top_k,
                     cudaStream_t stream, const SharePublishArgs* publish) {
  MOE_CUDA_REQUIRE(ids && route.positions && route.seq_of_token, "null pointer");
  MOE_CUDA_REQUIRE(tokens > 0 && n_experts > 0 && top_k > 0 && top_k <= n_experts, "top_k must be in [1, n_experts]");
  MOE_CUDA_REQUIRE(!route.trace || (route.trace_tokens > 0 && route.layer >= 0 && route.layer < route.trace_layers),
                   "replay: the trace needs tokens and this layer");
  MOE_CUDA_REQUIRE(!publish || (publish->tokens == tokens && tokens <= kShareMaxTokens && publish->ids == ids &&
                                publish->route_w && publish->top_k == top_k && top_k <= kShareMaxTopK &&
                                publish->slot),
                   "publish: at most 8 tokens, this call's ids, the router's weights, top_k <= 16");
  const SharePublishArgs none;
  const int block = publish ? 32 : 128;
  MOE_CUDA_TRY(detail::launch_pdl(force_experts_kernel, dim3((tokens + block - 1) / block), dim3(block), 0, stream,
                                  route, ids, tokens, n_experts, top_k, publish ? *publish : none));
  MOE_CUDA_LAUNCHED();
  return {};
}

int replay_row(int32_t seq, int32_t position, int trace_tokens) {
  return replay_row_of(seq, position, trace_tokens);
}

}  // namespace moe::cuda
