#pragma once
// One token's decode pass through every layer in a single launch
// (docs/fused-decode.md). A persistent grid of one block a multiprocessor
// walks the layers; grid-wide barriers stand between the phases of a layer
// where the chain of kernels had a launch each:
//   1. RMSNorm + q|k|v GEMV
//   2. q/k norms, RoPE, the new K/V row stored, attention over the keys
//      (split over blocks by key runs, merged by the last run's block)
//   3. o GEMV, added to the residual
//   4. RMSNorm + router GEMV
//   5. softmax + top-k (every block, from the logits), the experts'
//      gate|up + SiLU
//   6. the experts' down projection, weighted, added to the residual.
// While a phase runs, each warp asks L2 for the weights it will read in the
// next one (the dense matrices' rows it owns, the chosen experts' down
// rows), so the next phase's reads mostly come from L2.
// Scope: one token, GQA attention over bf16 KV rows, every layer a MoE layer
// without a shared expert, bf16 or INT8 dense matrices, INT4 experts with
// groups of 32 inputs or more (fused_decode_supported says why not).
// Twins: the chain of kernels in cuda_engine/forward.cpp, which the engine
// tests hold it to.

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "kernels/cuda/router.cuh"
#include "model/int4.h"
#include "model/result.h"

namespace moe::cuda {

// A dense matrix [rows, cols]: bf16 (w), or INT8 (q) with one f32 scale a row.
struct FusedMatrix {
  const __nv_bfloat16* w = nullptr;
  const int8_t* q = nullptr;
  const float* scale = nullptr;
};

struct FusedLayer {
  const __nv_bfloat16* in_norm = nullptr;   // [hidden]
  const __nv_bfloat16* post_norm = nullptr; // [hidden]
  const __nv_bfloat16* qkv_b = nullptr;     // [qkv width] or null
  const __nv_bfloat16* q_norm = nullptr;    // [head_dim] (per head) or [n_heads * head_dim] (full width), or null
  const __nv_bfloat16* k_norm = nullptr;
  FusedMatrix qkv, o, router;               // [qkv width, hidden], [hidden, n_heads * head_dim], [n_experts, hidden]
  __nv_bfloat16* k_pool = nullptr;          // block 0's rows (PagedKvPool's layout, bf16)
  __nv_bfloat16* v_pool = nullptr;
  int64_t kv_block_stride = 0;              // elements from one block's rows to the next (may be negative)
  const uint8_t* const* blobs = nullptr;    // [n_experts] the layer's expert blobs on the device
  int32_t* ids = nullptr;                   // [top_k] out: the experts the token took
};

struct FusedDecodeArgs {
  const FusedLayer* layers = nullptr;  // device array [n_layers]
  int n_layers = 0;
  int hidden = 0, n_heads = 0, n_kv = 0, head_dim = 0, n_experts = 0, top_k = 0;
  bool int8 = false;                   // the dense matrices are INT8 (else bf16)
  float eps = 1e-6f;
  bool qk_norm_full_width = false;
  bool renormalize = false;            // the router's top-k weights sum to 1
  float routed_scaling = 1.f;
  const float* inv_freq = nullptr;     // [head_dim / 2]
  float attention_factor = 1.f;
  float softmax_scale = 1.f;
  ExpertLayout layout{};
  const int32_t* position = nullptr;   // [1]
  const int32_t* block_table = nullptr;// the sequence's KV blocks
  int block_tokens = 0;
  // Benchmark routing: the router's choice replaced as force_experts does
  // (route.layer is each layer's own index).
  bool forced = false;
  ForcedRouting route{};
  // Workspace (FusedWorkspace sizes it; counts and barrier zero at start).
  float* x = nullptr;          // [hidden]: the residual, in and out
  float* qkv = nullptr;        // [(n_heads + 2 n_kv) * head_dim]
  float* attn = nullptr;       // [n_heads * head_dim]
  float* partials = nullptr;   // [n_kv, max_splits, group, head_dim + 2]
  int max_splits = 1;
  uint32_t* counts = nullptr;  // [n_kv], zero; each merge leaves it zero
  float* logits = nullptr;     // [n_experts]
  float* h = nullptr;          // [top_k * inter]
  uint32_t* barrier = nullptr; // [1], set to zero before each launch (fused_decode does)
  // Benchmarks: block 0's clock (ns) at the start, then as it reaches and as
  // it leaves each phase's barrier: [1 + n_layers * kFusedPhases * 2]; null: none.
  uint64_t* stamps = nullptr;
};

inline constexpr int kFusedPhases = 6;  // q|k|v, attention, o, router, gate|up, down

// The key runs a launch splits attention into at most, for contexts up to
// max_context on `blocks` blocks (the partials' size).
int fused_decode_max_splits(int max_context, int n_kv, int blocks);
size_t fused_decode_partials_floats(int max_context, int n_kv, int n_heads, int head_dim, int blocks);

// Empty when the kernel serves these shapes on this device, else why not.
std::string fused_decode_unsupported(const FusedDecodeArgs& shapes, int device);

// Blocks a launch takes on `device` (one a multiprocessor).
int fused_decode_blocks(int device);

// Zeroes the barrier, then launches the pass (cooperatively: every block
// resident at once) on `stream`; capturable in a CUDA graph.
Status fused_decode(const FusedDecodeArgs& a, int blocks, cudaStream_t stream);

}  // namespace moe::cuda
