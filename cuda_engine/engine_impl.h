// The CUDA engine's insides, shared by its files (docs/cuda-worker.md):
// the Impl every part works on, the dense-matrix type and the sizes the
// parts agree on. Private: only the files of cuda_engine/ include it.
//   create.cpp          the budget, the plan, the arena, start-up
//   weights.cpp         the non-expert weights carved and quantised, the
//                       workspace, the experts' host source
//   forward.cpp         one forward pass: layers, GEMVs, the MoE layer
//   expert_binding.cpp  making a layer's experts resident (copy mode), the
//                       public warm / unload / residency calls
//   streamed_misses.cpp misses read over the link, the host's share
//   step.cpp            steps: KV blocks, pass packing, CUDA graphs,
//                       sampling, outputs
#pragma once

#include "cuda_engine/cuda_engine.h"

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <functional>
#include <numeric>
#include <thread>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <optional>

#include <sys/mman.h>
#include <unistd.h>
#include <type_traits>
#include <unordered_map>
#include <unordered_set>

#include "engine/weights.h"
#include "kernels/kv_code.h"
#include "card/nvml_card.h"
#include "residency/eviction_policy.h"
#include "residency/expert_predictor.h"
#include "cuda_engine/host_experts.h"
#include "cuda_engine/host_share.h"
#include "residency/island_arena.h"
#include "engine/forward.h"
#include "kernels/cpu/sampling.h"
#include "kernels/cuda/activation.cuh"
#include "kernels/cuda/attention.cuh"
#include "kernels/cuda/cuda_check.cuh"
#include "kernels/cuda/dense_matmul.cuh"
#include "kernels/cuda/embedding.cuh"
#include "kernels/cuda/expert_stage.cuh"
#include "kernels/cuda/fused_decode.cuh"
#include "kernels/cuda/host_share.cuh"
#include "kernels/cuda/mla.cuh"
#include "kernels/cuda/norm.cuh"
#include "kernels/cuda/q4_gemm.cuh"
#include "kernels/cuda/q4_gemv.cuh"
#include "kernels/cuda/rope.cuh"
#include "kernels/cuda/router.cuh"
#include "kernels/cuda/sampling.cuh"
#include "model/safetensors.h"

namespace moe {

// The parts' shared vocabulary (not part of the engine's interface).
namespace cuda_engine_detail {

using bf16 = __nv_bfloat16;

inline constexpr int kBlockTokens = 16;
inline constexpr int kMaxSampleRows = 64;  // sampled rows per forward pass
// Token adjustments (docs/sampling.md) of one pass's sampled rows together;
// a pass that would need more is split (one sequence has at most
// protocol::kMaxTokenAdjust = 2^17).
inline constexpr size_t kMaxPassAdjust = size_t(1) << 18;
inline constexpr size_t kAlign = 256;
inline constexpr size_t kDefaultMargin = size_t(512) << 20;  // free memory the default budget leaves
// Device memory CUDA graphs take when instantiated (decode graphs per batch
// size, with and without the host's share), kept out of the arena.
inline constexpr size_t kGraphReserve = size_t(64) << 20;
// What a context and the libraries take when nothing can measure it.
inline constexpr size_t kContextGuess = size_t(768) << 20;

inline size_t align_up(size_t v, size_t a) { return (v + a - 1) / a * a; }

// One layer's K (or V) pool of `blocks` blocks: bf16 rows, or the rows'
// one-byte codes then (16-byte aligned) their f32 scales (docs/kv-cache.md).
inline size_t kv_pool_bytes(size_t blocks, KvDtype dt, int n_kv, int head_dim) {
  const size_t rows = blocks * size_t(kBlockTokens) * size_t(n_kv);
  if (!kv_coded(dt)) return rows * size_t(head_dim) * 2;
  return align_up(rows * size_t(head_dim), 16) + rows * sizeof(float);
}

// Hands out aligned pieces of one region. With a null base it only counts,
// so the same code measures a region before the arena exists and carves it
// after.
struct Carver {
  uint8_t* base = nullptr;
  size_t used = 0;
  template <typename T>
  T* take(size_t count) {
    used = align_up(used, kAlign);
    T* p = base ? reinterpret_cast<T*>(base + used) : nullptr;
    used += count * sizeof(T);
    return p;
  }
};

// The distinct valid experts among `count` routed ids, in order of first use.
inline std::vector<int> distinct_experts(const int32_t* ids, int count, int n_experts) {
  std::vector<int> used;
  for (int i = 0; i < count; ++i)
    if (ids[i] >= 0 && ids[i] < n_experts && std::find(used.begin(), used.end(), ids[i]) == used.end())
      used.push_back(ids[i]);
  return used;
}

inline std::vector<uint16_t> bf16_of(const std::vector<float>& v) {
  std::vector<uint16_t> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = f32_to_bf16(v[i]);
  return out;
}

// One dense matrix [rows, cols] on the device: bf16, INT8 with one f32
// scale per row (w ~ scale[row] * q), or INT4 (q4: a matrix of its own in
// the layout of docs/int4-experts.md, q4m its offsets from q4).
struct DenseW {
  const __nv_bfloat16* w = nullptr;
  const int8_t* q = nullptr;
  const float* scale = nullptr;
  const uint8_t* q4 = nullptr;
  Q4MatrixLayout q4m{};
  int rows = 0, cols = 0;
  explicit operator bool() const { return w || q || q4; }
  bool quantised() const { return q || q4; }
  size_t elems() const { return size_t(rows) * size_t(cols); }
  // Rows [r0, r0 + n) as a matrix of their own.
  DenseW slice(int r0, int n) const {
    DenseW d = *this;
    if (w) d.w = w + size_t(r0) * cols;
    if (q) d.q = q + size_t(r0) * cols;
    if (scale) d.scale = scale + r0;
    if (q4) d.q4m = q4_row_slice(q4m, r0, n);
    d.rows = n;
    return d;
  }
};

// The dtype of the non-expert matrices (the embedding stays bf16).
enum class DenseDtype { bf16, int8, int4 };

inline const char* dense_name(DenseDtype t) { return t == DenseDtype::int4 ? "int4" : t == DenseDtype::int8 ? "int8" : "bf16"; }
// INT4 dense matrices: groups of 64 inputs (32 where the width needs it).
inline constexpr int kDenseQ4Group = 64;

}  // namespace cuda_engine_detail

using namespace cuda_engine_detail;

struct CudaEngine::Impl {
  std::atomic<uint64_t>* progress = nullptr;  // CudaEngine::set_progress
  // What the process holds on the device (docs/cuda-worker.md).
  std::unique_ptr<NvmlCard> meter;  // null without NVML
  std::string pci_bus_id;           // the device as NVML and nvidia-smi name it
  uint64_t base_device_bytes = 0;             // the context and libraries, before the arena
  uint64_t budget_bytes = 0;                  // --vram-budget (or the default), the whole process
  mutable uint64_t peak_device_bytes = 0;     // the largest process_bytes() seen
  uint64_t steps_since_check = 0;
  bool over_budget_said = false;
  void advanced() {
    if (progress) progress->fetch_add(1, std::memory_order_relaxed);
  }

  // ---- Model
  std::shared_ptr<ModelFiles> files;
  ModelDesc d;
  CudaEngineOptions opts;
  std::unique_ptr<ModelWeights> host_weights;  // mapping-backed views, the source of every upload
  ExpertLayout layout{};
  bool grouped_ok = false;
  int hidden = 0, qkv_width = 0, q_width = 0, n_experts = 0, top_k = 0, n_moe_layers = 0, vocab = 0;
  int max_context = 0, max_blocks = 0;
  int max_pass_tokens = 0;                // tokens per pass
  size_t h_rows = 0;        // rows of the GEMV expert scratch
  int gu_stride = 0;        // the widest layer's fused gate|up row: gu's size (a layer's rows are its mlp_rows apart)
  int mlp_inter_max = 0;    // widest shared / dense MLP
  float attention_factor = 1.f;
  float softmax_scale = 1.f;        // attention_softmax_scale (engine/forward.h)
  int rot_dim = 0;                  // the RoPE width: head_dim, or MLA's qk_rope_head_dim
  // Multi-head latent attention (DeepSeek-V2; docs/cuda-mla.md): the KV
  // cache holds latent rows of latent_width = kv_lora_rank + qk_rope_head_dim.
  bool mla = false;
  int latent_width = 0;
  // A 16-token block's part of one layer: its K (or V) rows, or MLA's
  // latent rows; a block holds a layer's K and V parts, or its latent part.
  size_t kv_part_bytes() const;
  size_t kv_block_bytes() const;
  uint8_t* pinned_experts = nullptr;  // experts quantised at load, page-locked (freed at the end)

  struct DevLayer {
    bf16 *in_norm = nullptr, *post_norm = nullptr, *qkv_b = nullptr;
    bf16 *q_norm = nullptr, *k_norm = nullptr;
    DenseW qkv_w, o_w;
    int moe_index = -1;  // -1: dense MLP
    DenseW router_w;
    DenseW mlp_gu_w, mlp_down_w;  // shared expert or dense MLP
    int mlp_inter = 0, mlp_rows = 0;                  // rows: gate | up | (gate logit) | (router), padded; gu's row stride
    int router_row = -1;                              // >= 0: the router's rows inside mlp_gu_w
    bool mlp_gated = false;                           // Qwen2-MoE: sigmoid gate logit at row 2*inter
    bf16 *k_pool = nullptr, *v_pool = nullptr;   // bf16 rows
    uint8_t *k_codes = nullptr, *v_codes = nullptr;  // coded rows (docs/kv-cache.md)
    float *k_scales = nullptr, *v_scales = nullptr;
    int64_t kv_block_stride = 0, kv_scale_block_stride = 0;  // PagedKvPool's (block 0's rows above, ids running down)
    // MLA: the latent's norm, W_UK per head transposed [n_heads * rank,
    // nope] and W_UV [n_heads * v_dim, rank] (bf16, cut from kv_b_proj), and
    // the latent rows (PagedLatentPool, kv_block_stride apart).
    bf16 *kv_a_norm = nullptr, *uk_t = nullptr, *uv = nullptr, *latent = nullptr;
  };
  std::vector<DevLayer> layers;
  bf16 *embed = nullptr, *final_norm = nullptr;
  DenseW lm_head;
  DenseDtype dense = DenseDtype::bf16;  // non-expert matrices (the embedding stays bf16)
  KvDtype kv_dtype = KvDtype::bf16;     // the KV cache's rows
  bool embed_host = false;        // the embedding lies in mapped pinned host memory, not the arena
  bf16* embed_host_buf = nullptr; // its cudaHostAlloc'ed rows then
  bf16* dequant = nullptr;        // prefill: a quantised matrix back in bf16 for cuBLASLt
  size_t dequant_elems = 0;       // the largest such matrix

  // ---- Device memory
  IslandPlan plan;
  std::unique_ptr<IslandArena> arena;
  std::unique_ptr<ResidencyMap> map;
  std::unique_ptr<ExpertPredictor> predictor;
  std::unique_ptr<cuda::CublasLtMatmul> mm;
  cudaStream_t st = nullptr;
  cudaEvent_t routes_ready = nullptr;  // budget mode: a layer's routes are on the host
  bool omit(uint32_t kernel) const { return (opts.bench_omit & kernel) != 0; }  // benchmarks: --omit
  bool all_resident = false;
  uint64_t residency_version = 0;

  // workspace
  float *x = nullptr, *qkv = nullptr, *router_logits = nullptr, *route_w = nullptr, *h = nullptr;
  float *gu = nullptr, *tmp = nullptr, *xs = nullptr, *logits = nullptr, *inv_freq = nullptr;
  int32_t *route_ids = nullptr, *sampled = nullptr;
  TokenAdjust* adjust_entries = nullptr;  // [kMaxPassAdjust]: the pass's token adjustments
  float* adjust_saved = nullptr;          // [kMaxPassAdjust]: each entry's logit before it
  uint32_t* allow_masks = nullptr;        // [kMaxSampleRows, mask_words]: tokens each constrained row may draw
  int mask_words = 0;                     // ceil(vocab / 32)
  bf16 *xn = nullptr, *q = nullptr, *attn = nullptr, *mh = nullptr, *xsn = nullptr;
  bf16 *q_abs = nullptr, *o_lat = nullptr;  // MLA: [tokens, n_heads, latent_width] and [tokens, n_heads, rank]
  float* mla_partials = nullptr;            // MLA: the key splits' softmax states (cuda::mla_splits)
  float* attn_partials = nullptr;           // decode attention's key splits' states (cuda::AttentionArgs)
  uint32_t* attn_split_counts = nullptr;    // [kGemvMaxTokens, n_heads], zero between calls
  const uint8_t** blob_tables = nullptr;  // [n_moe_layers, n_experts] device pointers
  void* grouped_ws = nullptr;
  size_t grouped_ws_bytes = 0;
  int16_t* trace_dev = nullptr;  // --routing replay: [trace_tokens][n_moe_layers][top_k]
  std::vector<int16_t> trace_host;
  int trace_tokens = 0;
  // Reads a recorded trace into trace_host, refusing one that is not of this
  // model's MoE layers, top-k and experts (create.cpp).
  Status load_routing_trace(const std::string& path);
  uint8_t* pack_dev = nullptr;  // a pass's inputs (layout: PassPack)
  size_t pack_bytes = 0;

  // pinned host mirrors
  uint8_t* pack_host = nullptr;
  const uint8_t** tables_host = nullptr;  // [n_moe_layers, n_experts]
  int32_t* ids_host = nullptr;            // [n_moe_layers, max_pass_tokens, top_k]
  int32_t* sampled_host = nullptr;        // [kMaxSampleRows]
  float* logits_host = nullptr;           // [kMaxSampleRows, vocab]
  TokenAdjust* adjust_host = nullptr;     // [kMaxPassAdjust]
  float* saved_host = nullptr;            // [kMaxPassAdjust]
  uint32_t* masks_host = nullptr;         // [kMaxSampleRows, mask_words]

  // ---- Misses split between the link and the host (budget mode, decode)
  std::unique_ptr<HostExperts> host_x;   // null: every miss is copied
  double link_us = 0;                    // one expert over the link (measured at start)
  double host_us_token = 0;              // one expert-token on the host (measured at start)
  static constexpr double kHostFixedUs = 25;  // state down, sum up, two fork-joins
  bf16* xn_host = nullptr;               // [8, hidden] pinned: the layer's expert input
  float* rw_host = nullptr;              // [8, top_k] pinned: route weights
  float* hsum_host = nullptr;            // [8, hidden] pinned: the host experts' sum
  int32_t* split_ids_host = nullptr;     // [8, top_k] pinned: ids with the host's pairs as -1
  float* hsum = nullptr;                 // [8, hidden] device (workspace)
  int32_t* split_ids = nullptr;          // [8, top_k] device (workspace)
  std::vector<HostPair> host_pairs;      // this layer's, when bind_experts split it
  uint64_t host_experts_served = 0, host_expert_tokens = 0;
  uint64_t router_guesses = 0;  // layers whose prefetch took the next router's guess

  // ---- Streamed misses (budget mode, decode; docs/cuda-worker.md)
  // The pass in flight reads every expert through blob_tables: an island
  // when the expert is resident and its copy has landed, else its pinned
  // host blob over the link. Nothing is pinned, no host waits inside.
  bool streaming = false;
  bool stream_tables_stale = true;  // residency changed outside streamed passes: rebuild the tables
  struct Landing {
    ExpertKey key;
    int64_t island;
  };
  std::vector<Landing> admitted;    // copied in after the last pass
  std::vector<Landing> landing;     // copied in after the one before: read from their islands next
  uint64_t bytes_streamed = 0;
  uint8_t* on_gpu_host = nullptr;  // [n_moe_layers, n_experts] pinned: 1 where the table names an island
  uint8_t* on_gpu = nullptr;       // [n_moe_layers, n_experts] device (workspace): what share_publish reads
  Status upload_stream_tables();

  // ---- The host's share of streamed decode passes (host_experts with
  // misses "stream"; cuda_engine/host_share.h). Mapped pinned memory: one
  // ShareSlot per MoE layer, then [n_moe_layers, kShareMaxTokens, hidden] bf16 states, then
  // [n_moe_layers, kShareMaxTokens, hidden] f32 sums.
  std::unique_ptr<HostShare> share;
  uint8_t* share_host = nullptr;
  ShareSlot* share_slots_dev = nullptr;
  bf16* share_x_dev = nullptr;
  float* share_sum_dev = nullptr;
  uint16_t* share_rows = nullptr;    // [kShareMaxTokens * top_k + 1] device (workspace): share_rows_table
  int32_t* share_split = nullptr;    // [kShareMaxTokens * top_k] device (workspace): Q4ExpertArgs::split
  uint32_t* share_pass = nullptr;    // device (workspace): the pass number the kernels compare
  uint32_t* share_count = nullptr;   // [n_moe_layers] device (workspace)
  int32_t* share_ids = nullptr;      // [kShareMaxTokens * top_k] device (workspace): the GPU's experts, the host's as -1
  uint32_t* pass_host = nullptr;     // pinned
  uint32_t share_pass_no = 0;
  bool sharing = false;              // this pass
  // Misses a MoE layer of recent streamed passes (a moving average, from
  // "many" at start). A shared layer costs ~4 µs of hand-overs (the Qwen3
  // shape at 12 GiB with the router's routing, 0.03 misses a layer, went
  // 387 -> 362 tok/s sharing every pass), and a miss the host takes rows
  // of saves ~a third of its 53 µs over the link: passes share from a
  // quarter of a miss a layer on.
  // Kept per pass size: a pass of 8 tokens misses more experts a layer than
  // one of 1, and its passes must not switch sharing on for the other's.
  std::array<double, kShareMaxTokens + 1> share_misses = [] {
    std::array<double, kShareMaxTokens + 1> a;
    a.fill(8.0);  // "many" at start
    return a;
  }();
  static constexpr double kShareMinMisses = 0.25;
  static constexpr double kShareFixedUs = 8;   // post and collect, over the link both ways
  static constexpr int kShareTimeoutMs = 5000;  // the host gone this long: the device traps
  Status start_host_share();
  Result<double> measure_link_us();
  bool stream_pass(int n) const {
    return !all_resident && opts.misses == MissMode::stream && n <= cuda::kGemvMaxTokens &&
           size_t(n) * top_k < 4 * size_t(n_experts);
  }
  Status prepare_streamed_pass();
  Status after_streamed_pass(int n);

  // ---- Sequences and their KV blocks (block-major from the arena's top: DevLayer)
  std::unique_ptr<KvBlockPool> kv_pool;
  int kv_blocks = 0;  // at start
  // KV and islands trading places (kv_trade.cpp, docs/kv-islands-trade.md)
  static constexpr int kKvGrowChunk = 64;  // blocks a grow takes at least
  bool kv_trade = false;                   // under a budget, with CudaEngineOptions::kv_trade
  int kv_floor = 0;                        // the start's blocks: the pool never gives those back
  int64_t kv_reachable = 0;                // the most blocks, leaving one layer's experts in islands
  uint64_t kv_roomy_since_ms = 0;          // more than half the blocks free since (0: not now)
  uint64_t kv_grows = 0, kv_shrinks = 0, kv_islands_taken = 0;
  int kv_growable() const;
  // Adds at least `need` blocks (a chunk when more are free to take),
  // retiring the islands the pool grows over.
  Status grow_kv(int need);
  void kv_after_step();
  void kv_idle();

  // ---- Decode graphs (resident and streamed passes), keyed by batch size,
  // whether the host shares the pass and the attention's splits
  // ((2 n + sharing) * 32 + splits; one splits class instantiated a key)
  struct Graph {
    int seen = 0;
    cudaGraphExec_t exec = nullptr;
  };
  std::map<int, Graph> graphs;

  // ---- The fused decode pass (kernels/cuda/fused_decode.cuh): resident
  // decode passes of one token, every layer in one launch.
  bool fused_ok = false;                  // set up at start; else fused_why says why not
  std::string fused_why = "off";
  bool pass_fused = false;                // this pass
  uint64_t fused_passes = 0;
  int fused_blocks = 0;
  cuda::FusedDecodeArgs fused{};          // everything but the pass's own pointers
  cuda::FusedLayer* fused_layers = nullptr;  // workspace [n_layers]
  Status setup_fused();                   // create.cpp, once the KV pool and the expert tables exist

  // The pass in flight's shortest run of one sequence's tokens (its pieces):
  // where every run is a prompt's, the attention walks the queries in tiles
  // (cuda::AttentionArgs::shortest_run).
  int pass_shortest_run = 0;
  // The pass's decode attention splits (cuda::attention_splits_for its
  // longest query): decode graphs are kept per class as well.
  int pass_attn_splits = 1;
  int pass_split_keys = cuda::kAttentionSplitKeys;  // and the run of keys a split takes at least
  int sm_count = 1;  // the device's multiprocessors
  // Where a pass's inputs sit in the pack (a function of its sizes only, so
  // that a captured graph's pointers stay valid for every pass of that size).
  struct PassPack {
    size_t tokens = 0, positions = 0, seq_of_token = 0, routing_seq = 0, sample_rows = 0, sample_pos = 0,
           params = 0, adjust_spans = 0, tables = 0, bytes = 0;
  };
  PassPack pack_layout(int n, int s, int pieces) const {
    PassPack p;
    size_t o = 0;
    auto put = [&](size_t& field, size_t bytes) {
      o = align_up(o, 16);
      field = o;
      o += bytes;
    };
    put(p.tokens, size_t(n) * 4);
    put(p.positions, size_t(n) * 4);
    put(p.seq_of_token, size_t(n) * 4);
    put(p.routing_seq, size_t(n) * 4);
    put(p.sample_rows, size_t(std::max(s, 1)) * 4);
    put(p.sample_pos, size_t(std::max(s, 1)) * 8);
    put(p.params, size_t(std::max(s, 1)) * sizeof(SampleDraw));
    put(p.adjust_spans, size_t(std::max(s, 1)) * sizeof(AdjustSpan));
    put(p.tables, size_t(pieces) * max_blocks * 4);
    p.bytes = o;
    return p;
  }

  ~Impl() {
    if (st) (void)cudaStreamSynchronize(st);
    for (auto& [b, g] : graphs)
      if (g.exec) (void)cudaGraphExecDestroy(g.exec);
    arena.reset();
    mm.reset();
    if (pack_host) (void)cudaFreeHost(pack_host);
    if (embed_host_buf) (void)cudaFreeHost(embed_host_buf);
    if (tables_host) (void)cudaFreeHost(tables_host);
    if (ids_host) (void)cudaFreeHost(ids_host);
    if (sampled_host) (void)cudaFreeHost(sampled_host);
    if (logits_host) (void)cudaFreeHost(logits_host);
    if (adjust_host) (void)cudaFreeHost(adjust_host);
    if (saved_host) (void)cudaFreeHost(saved_host);
    if (masks_host) (void)cudaFreeHost(masks_host);
    for (void* p : {static_cast<void*>(xn_host), static_cast<void*>(rw_host), static_cast<void*>(hsum_host),
                    static_cast<void*>(split_ids_host), static_cast<void*>(guess_ids_host)})
      if (p) (void)cudaFreeHost(p);
    share.reset();  // its threads stop before the memory they read goes
    for (void* p : {static_cast<void*>(share_host), static_cast<void*>(pass_host), static_cast<void*>(on_gpu_host)})
      if (p) (void)cudaFreeHost(p);
    if (routes_ready) (void)cudaEventDestroy(routes_ready);
    if (side) (void)cudaStreamSynchronize(side);
    for (cudaEvent_t e : stage_fork)
      if (e) (void)cudaEventDestroy(e);
    if (stage_join) (void)cudaEventDestroy(stage_join);
    if (side) (void)cudaStreamDestroy(side);
    if (stage_landed_host) (void)cudaFreeHost(stage_landed_host);
    if (st) (void)cudaStreamDestroy(st);
    if (pinned_experts) (void)cudaFreeHost(pinned_experts);
  }

  Status carve_weights(Carver& c, bool upload);
  void carve_workspace(Carver& c);
  Status expert_source(ExpertHostSource& src);
  Status forward(const PassPack& pk, int n, int s);
  Status fused_pass(const PassPack& pk);  // the layers of a resident decode pass of one token, in one launch
  // A layer's attention after its first projection (qkv): RoPE and the KV
  // store, attention, into `attn` (before o_proj).
  Status attention_gqa(const DevLayer& L, int n, const int32_t* positions, const int32_t* seq_of_token,
                       const int32_t* tables);
  Status attention_mla(const DevLayer& L, int n, const int32_t* positions, const int32_t* seq_of_token,
                       const int32_t* tables);
  // positions / routing_seq: the pass's, on the device (benchmark routing
  // forces experts from them: ForcedRouting); the layer's shared expert
  // runs inside (see forward).
  Status moe_layer(const DevLayer& L, int n, bool logits_ready, const int32_t* positions, const int32_t* routing_seq,
                   bool fuse);
  // The shared expert or dense MLP from gu (its gate|up), added to x.
  Status mlp(const DevLayer& L, int n, bool fuse);
  // The layer's routed experts on the GPU (and the host's share, when
  // bind_experts split the misses), added to x.
  Status routed_experts(int ml, int n, const int32_t* ids);
  // y[n, mat.rows] (+)= x mat^T, bf16 or INT8 weights; GEMV up to 8 rows of x,
  // cuBLASLt above (an INT8 matrix is first turned back into bf16).
  Status project(const DenseW& mat, const bf16* x, float* y, int n, bool acc);
  Status gemv(const DenseW& mat, const bf16* x, float* y, int n, bool acc, const float* gate, int gate_stride);
  Status gemv_rmsnorm(const DenseW& mat, const float* xf, const bf16* norm_w, bf16* xn_out, float* y, int n);
  Status gemv_silu(const DenseW& mat, const float* gu_in, int stride, float* y, int n, const float* gate);
  // Reads the layer's routes, makes its experts resident (or leaves misses
  // to the host); `meanwhile` enqueues GPU work that does not depend on the
  // routed experts while the host waits for the routes.
  Status bind_experts(int ml, int n, const std::function<Status()>& meanwhile);
  // Copy mode, decode: the next MoE layer's router on this layer's residual
  // after attention (its own MLP norm first), top-k per token, on its way
  // to guess_ids_host before bind_experts waits for the routes; bind_experts
  // then prefetches those instead of the transition table's guesses
  // (docs/expert-prediction.md, "Layer-ahead prediction").
  Status guess_next_layer(int ml, int n);
  float* guess_logits = nullptr;      // [8, n_experts] workspace
  float* guess_w = nullptr;           // [8, top_k] workspace
  int32_t* guess_ids = nullptr;       // [8, top_k] workspace
  int32_t* guess_ids_host = nullptr;  // [8, top_k] pinned
  int guess_tokens = 0;               // tokens whose guesses guess_ids_host holds for the next layer (0: none)
  std::vector<int> layer_of_moe;      // [n_moe_layers]: the model layer of each MoE layer

  // ---- Layer-ahead staging in streamed passes of one token (opts.stream_ahead;
  // kernels/cuda/expert_stage.cuh, docs/expert-prediction.md "Streamed passes")
  bool staging = false;                       // this pass stages
  cudaStream_t side = nullptr;                // the guesses and copies
  std::vector<cudaEvent_t> stage_fork;        // [n_moe_layers] each layer's fork point on st
  cudaEvent_t stage_join = nullptr;           // the side stream's end, joined before the pass ends
  uint8_t* stage_slots = nullptr;             // workspace [2 * top_k, stage_slot_bytes]
  size_t stage_slot_bytes = 0;
  const uint8_t** host_blobs_dev = nullptr;   // workspace [n_moe_layers, n_experts] mapped host blobs
  int2* stage_keys = nullptr;                 // workspace [2 * top_k]
  uint32_t* stage_arrived = nullptr;          // workspace [2 * top_k]
  uint32_t* stage_landed = nullptr;           // workspace [1]: experts staged over the engine's life
  uint32_t* stage_landed_host = nullptr;      // pinned copy, read after each staging pass
  uint32_t stage_landed_seen = 0;             // its value at the last read (a 32-bit count wraps)
  int32_t* stage_reached = nullptr;           // workspace [1]: the MoE layer the compute stream has reached
  float* x_snap = nullptr;                    // workspace [hidden]: the residual the side stream guesses from
  uint64_t experts_staged = 0;
  cuda::StageArgs stage_args(int ml) const;
  Status start_staging();                     // create.cpp: stream, events, slots emptied, host blobs listed
  // At MoE layer ml's start (the residual after attention): fork the side
  // stream, guess layer ml + 1's experts there and stage them (forward.cpp).
  Status stage_next_layer(int ml, int n, const int32_t* positions, const int32_t* routing_seq);
  Status end_staging();                       // join the side stream, put the tables back
  Status forward_layers(const PassPack& pk, int n, int s);  // forward() but for the staging's join
  Status release_experts(int ml);
  Status start_host_experts();
  std::vector<std::vector<int>> bound;  // [n_moe_layers] experts pinned for the layer's kernels
};

}  // namespace moe
