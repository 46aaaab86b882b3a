#include "gpu_worker/cuda_engine.h"

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
#include "gpu_worker/device_memory.h"
#include "gpu_worker/eviction_policy.h"
#include "gpu_worker/expert_predictor.h"
#include "gpu_worker/host_experts.h"
#include "gpu_worker/host_share.h"
#include "gpu_worker/island_arena.h"
#include "engine/forward.h"
#include "kernels/cpu/sampling.h"
#include "kernels/cuda/activation.cuh"
#include "kernels/cuda/attention.cuh"
#include "kernels/cuda/cuda_check.cuh"
#include "kernels/cuda/dense_matmul.cuh"
#include "kernels/cuda/embedding.cuh"
#include "kernels/cuda/host_share.cuh"
#include "kernels/cuda/norm.cuh"
#include "kernels/cuda/q4_gemm.cuh"
#include "kernels/cuda/q4_gemv.cuh"
#include "kernels/cuda/rope.cuh"
#include "kernels/cuda/router.cuh"
#include "kernels/cuda/sampling.cuh"
#include "model/safetensors.h"

#define ENGINE_TRY(expr)                                  \
  do {                                                    \
    ::moe::Status st_ = (expr);                           \
    if (!st_.ok()) return ::moe::make_error(st_.error()); \
  } while (0)

namespace moe {

namespace {

using bf16 = __nv_bfloat16;

constexpr int kBlockTokens = 16;
constexpr int kMaxSampleRows = 64;  // sampled rows per forward pass
constexpr size_t kAlign = 256;
constexpr size_t kDefaultMargin = size_t(512) << 20;  // free memory the default budget leaves
// Device memory CUDA graphs take when instantiated (decode graphs per batch
// size, with and without the host's share), kept out of the arena.
constexpr size_t kGraphReserve = size_t(64) << 20;
// What a context and the libraries take when nothing can measure it.
constexpr size_t kContextGuess = size_t(768) << 20;

size_t align_up(size_t v, size_t a) { return (v + a - 1) / a * a; }

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

// Rows of a Linear [out, in] as bf16 bits, appended to `out`.
void append_bf16_rows(const Linear& L, std::vector<uint16_t>& out) {
  const size_t at = out.size();
  out.resize(at + size_t(L.out) * L.in);
  uint16_t* dst = out.data() + at;
  if (L.bf16) {
    std::memcpy(dst, L.bf16, size_t(L.out) * L.in * 2);
    return;
  }
  std::vector<float> row(size_t(L.in));
  for (int r = 0; r < L.out; ++r) {
    L.row(r, row.data());
    for (int c = 0; c < L.in; ++c) dst[size_t(r) * L.in + c] = f32_to_bf16(row[size_t(c)]);
  }
}

// Symmetric INT8 per row: q = round(w / scale), scale = max|row| / 127.
void quantize_rows_i8_host(const uint16_t* w, int rows, int cols, int8_t* q, float* scale) {
  for (int r = 0; r < rows; ++r) {
    const uint16_t* row = w + size_t(r) * cols;
    float mx = 0.f;
    for (int c = 0; c < cols; ++c) mx = std::max(mx, std::abs(bf16_to_f32(row[c])));
    const float sc = mx > 0.f ? mx / 127.f : 1.f;
    scale[r] = sc;
    for (int c = 0; c < cols; ++c)
      q[size_t(r) * cols + c] = int8_t(std::lrintf(std::clamp(bf16_to_f32(row[c]) / sc, -127.f, 127.f)));
  }
}

// The distinct valid experts among `count` routed ids, in order of first use.
std::vector<int> distinct_experts(const int32_t* ids, int count, int n_experts) {
  std::vector<int> used;
  for (int i = 0; i < count; ++i)
    if (ids[i] >= 0 && ids[i] < n_experts && std::find(used.begin(), used.end(), ids[i]) == used.end())
      used.push_back(ids[i]);
  return used;
}

std::vector<uint16_t> bf16_of(const std::vector<float>& v) {
  std::vector<uint16_t> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = f32_to_bf16(v[i]);
  return out;
}

}  // namespace

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

namespace {

const char* dense_name(DenseDtype t) { return t == DenseDtype::int4 ? "int4" : t == DenseDtype::int8 ? "int8" : "bf16"; }
// INT4 dense matrices: groups of 64 inputs (32 where the width needs it).
constexpr int kDenseQ4Group = 64;

// Quantises bf16 rows into an INT4 matrix (model/int4.h) with the host's
// threads, each taking slabs of rows.
void quantize_rows_q4_host(const uint16_t* w, const Q4MatrixLayout& m, uint8_t* blob) {
  const int threads = int(std::clamp(std::thread::hardware_concurrency(), 1u, 16u));
  constexpr int kSlab = 256;
  const int slabs = (m.rows + kSlab - 1) / kSlab;
  std::atomic<int> next{0};
  auto work = [&] {
    std::vector<float> f;
    for (int i = next++; i < slabs; i = next++) {
      const int r0 = i * kSlab, n = std::min(kSlab, m.rows - r0);
      f.resize(size_t(n) * m.cols);
      const uint16_t* src = w + size_t(r0) * m.cols;
      for (size_t j = 0; j < f.size(); ++j) f[j] = bf16_to_f32(src[j]);
      q4_quantize_matrix(f.data(), q4_row_slice(m, r0, n), blob);
    }
  };
  std::vector<std::thread> team;
  for (int t = 1; t < std::min(threads, slabs); ++t) team.emplace_back(work);
  work();
  for (std::thread& t : team) t.join();
}

}  // namespace

struct CudaEngine::Impl {
  std::atomic<uint64_t>* progress = nullptr;  // CudaEngine::set_progress
  // What the process holds on the device (docs/cuda-worker.md).
  std::unique_ptr<DeviceMemoryMeter> meter;  // null without NVML
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
  int H = 0, W = 0, QD = 0, E = 0, K = 0, Lm = 0, V = 0;
  int max_context = 0, max_blocks = 0;
  int T = 0;                // tokens per pass
  size_t h_rows = 0;        // rows of the GEMV expert scratch
  int gu_stride = 0;        // row stride of the fused gate|up output
  int mlp_inter_max = 0;    // widest shared / dense MLP
  float attention_factor = 1.f;
  uint8_t* pinned_experts = nullptr;  // experts quantised at load, page-locked (freed at the end)

  struct DevLayer {
    bf16 *in_norm = nullptr, *post_norm = nullptr, *qkv_b = nullptr;
    bf16 *q_norm = nullptr, *k_norm = nullptr;
    DenseW qkv_w, o_w;
    int moe_index = -1;  // -1: dense MLP
    DenseW router_w;
    DenseW mlp_gu_w, mlp_down_w;  // shared expert or dense MLP
    int mlp_inter = 0, mlp_rows = 0;                  // rows: gate | up | (gate logit) | (router), padded
    int router_row = -1;                              // >= 0: the router's rows inside mlp_gu_w
    bool mlp_gated = false;                           // Qwen2-MoE: sigmoid gate logit at row 2*inter
    bf16 *k_pool = nullptr, *v_pool = nullptr;
  };
  std::vector<DevLayer> layers;
  bf16 *embed = nullptr, *final_norm = nullptr;
  DenseW lm_head;
  DenseDtype dense = DenseDtype::bf16;  // non-expert matrices (the embedding stays bf16)
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
  bool all_resident = false;
  uint64_t residency_version = 0;

  // workspace
  float *x = nullptr, *qkv = nullptr, *router_logits = nullptr, *route_w = nullptr, *h = nullptr;
  float *gu = nullptr, *tmp = nullptr, *xs = nullptr, *logits = nullptr, *inv_freq = nullptr;
  int32_t *route_ids = nullptr, *sampled = nullptr;
  bf16 *xn = nullptr, *q = nullptr, *attn = nullptr, *mh = nullptr, *xsn = nullptr;
  const uint8_t** blob_tables = nullptr;  // [Lm, E] device pointers
  void* grouped_ws = nullptr;
  size_t grouped_ws_bytes = 0;
  uint8_t* pack_dev = nullptr;  // a pass's inputs (layout: PassPack)
  size_t pack_bytes = 0;

  // pinned host mirrors
  uint8_t* pack_host = nullptr;
  const uint8_t** tables_host = nullptr;  // [Lm, E]
  int32_t* ids_host = nullptr;            // [Lm, T, K]
  int32_t* sampled_host = nullptr;        // [kMaxSampleRows]
  float* logits_host = nullptr;           // [kMaxSampleRows, V]

  // ---- Misses split between the link and the host (budget mode, decode)
  std::unique_ptr<HostExperts> host_x;   // null: every miss is copied
  double link_us = 0;                    // one expert over the link (measured at start)
  double host_us_token = 0;              // one expert-token on the host (measured at start)
  static constexpr double kHostFixedUs = 25;  // state down, sum up, two fork-joins
  bf16* xn_host = nullptr;               // [8, H] pinned: the layer's expert input
  float* rw_host = nullptr;              // [8, K] pinned: route weights
  float* hsum_host = nullptr;            // [8, H] pinned: the host experts' sum
  int32_t* split_ids_host = nullptr;     // [8, K] pinned: ids with the host's pairs as -1
  float* hsum = nullptr;                 // [8, H] device (workspace)
  int32_t* split_ids = nullptr;          // [8, K] device (workspace)
  std::vector<HostPair> host_pairs;      // this layer's, when bind_experts split it
  uint64_t host_experts_served = 0, host_expert_tokens = 0;

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
  uint8_t* on_gpu_host = nullptr;  // [Lm, E] pinned: 1 where the table names an island
  uint8_t* on_gpu = nullptr;       // [Lm, E] device (workspace): what share_publish reads
  Status upload_stream_tables();

  // ---- The host's share of streamed decode passes (host_experts with
  // misses "stream"; gpu_worker/host_share.h). Mapped pinned memory: one
  // ShareSlot per MoE layer, then [Lm, kShareMaxTokens, H] bf16 states, then
  // [Lm, kShareMaxTokens, H] f32 sums.
  std::unique_ptr<HostShare> share;
  uint8_t* share_host = nullptr;
  ShareSlot* share_slots_dev = nullptr;
  bf16* share_x_dev = nullptr;
  float* share_sum_dev = nullptr;
  uint16_t* share_rows = nullptr;    // [kShareMaxTokens K + 1] device (workspace): share_rows_table
  int32_t* share_split = nullptr;    // [kShareMaxTokens K] device (workspace): Q4ExpertArgs::split
  uint32_t* share_pass = nullptr;    // device (workspace): the pass number the kernels compare
  uint32_t* share_count = nullptr;   // [Lm] device (workspace)
  int32_t* share_ids = nullptr;      // [kShareMaxTokens K] device (workspace): the GPU's experts, the host's as -1
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
    return !all_resident && opts.misses == "stream" && n <= cuda::kGemvMaxTokens &&
           size_t(n) * K < 4 * size_t(E);
  }
  Status prepare_streamed_pass();
  Status after_streamed_pass(int n);

  // ---- Sequences and KV blocks
  struct Sequence {
    std::vector<int32_t> blocks;
    int32_t length = 0;
  };
  std::unordered_map<uint64_t, Sequence> seqs;
  std::vector<int32_t> free_blocks;
  int kv_blocks = 0;

  // ---- Decode graphs (resident and streamed passes), keyed by batch size
  // and whether the host shares the pass (2 n + sharing)
  struct Graph {
    int seen = 0;
    cudaGraphExec_t exec = nullptr;
  };
  std::map<int, Graph> graphs;

  // Where a pass's inputs sit in the pack (a function of its sizes only, so
  // that a captured graph's pointers stay valid for every pass of that size).
  struct PassPack {
    size_t tokens = 0, positions = 0, seq_of_token = 0, sample_rows = 0, sample_pos = 0,
           params = 0, tables = 0, bytes = 0;
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
    put(p.sample_rows, size_t(std::max(s, 1)) * 4);
    put(p.sample_pos, size_t(std::max(s, 1)) * 8);
    put(p.params, size_t(std::max(s, 1)) * sizeof(cuda::SampleRowParams));
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
    for (void* p : {static_cast<void*>(xn_host), static_cast<void*>(rw_host), static_cast<void*>(hsum_host),
                    static_cast<void*>(split_ids_host)})
      if (p) (void)cudaFreeHost(p);
    share.reset();  // its threads stop before the memory they read goes
    for (void* p : {static_cast<void*>(share_host), static_cast<void*>(pass_host), static_cast<void*>(on_gpu_host)})
      if (p) (void)cudaFreeHost(p);
    if (routes_ready) (void)cudaEventDestroy(routes_ready);
    if (st) (void)cudaStreamDestroy(st);
    if (pinned_experts) (void)cudaFreeHost(pinned_experts);
  }

  Status carve_weights(Carver& c, bool upload);
  void carve_workspace(Carver& c);
  Status expert_source(ExpertHostSource& src);
  Status forward(const PassPack& pk, int n, int s);
  // positions / seq_of_token: the pass's, on the device (uniform routing
  // draws from them); the layer's shared expert runs inside (see forward).
  Status moe_layer(const DevLayer& L, int n, bool logits_ready, const int32_t* positions, const int32_t* seq_of_token,
                   bool fuse);
  // The shared expert or dense MLP from gu (its gate|up), added to x.
  Status mlp(const DevLayer& L, int n, bool fuse);
  // The layer's routed experts on the GPU (and the host's share, when
  // bind_experts split the misses), added to x.
  Status routed_experts(int ml, int n, const int32_t* ids);
  // y[n, W.rows] (+)= x W^T, bf16 or INT8 weights; GEMV up to 8 rows of x,
  // cuBLASLt above (an INT8 matrix is first turned back into bf16).
  Status project(const DenseW& W, const bf16* x, float* y, int n, bool acc);
  Status gemv(const DenseW& W, const bf16* x, float* y, int n, bool acc, const float* gate, int gate_stride);
  Status gemv_rmsnorm(const DenseW& W, const float* xf, const bf16* norm_w, bf16* xn_out, float* y, int n);
  Status gemv_silu(const DenseW& W, const float* gu_in, int stride, float* y, int n, const float* gate);
  // Reads the layer's routes, makes its experts resident (or leaves misses
  // to the host); `meanwhile` enqueues GPU work that does not depend on the
  // routed experts while the host waits for the routes.
  Status bind_experts(int ml, int n, const std::function<Status()>& meanwhile);
  Status release_experts(int ml);
  Status start_host_experts();
  std::vector<std::vector<int>> bound;  // [Lm] experts pinned for the layer's kernels
};

// ---------------------------------------------------------------- weights

Status CudaEngine::Impl::carve_weights(Carver& c, bool upload) {
  const ModelWeights& w = *host_weights;
  lm_head = DenseW{};
  bool head_is_embed = false;  // a tied bf16 lm_head is the embedding, stored once
  std::vector<uint16_t> buf;
  auto put = [&](bf16** dst, const std::vector<uint16_t>& data) -> Status {
    *dst = c.take<bf16>(data.size());
    if (upload && !data.empty())
      MOE_CUDA_TRY(cudaMemcpy(*dst, data.data(), data.size() * 2, cudaMemcpyHostToDevice));
    return {};
  };
  // The same sizes in the measuring pass, without converting anything.
  auto reserve = [&](bf16** dst, size_t elems) { *dst = c.take<bf16>(elems); };
  // A dense matrix made of `parts` stacked by rows (+ pad_rows zero rows),
  // in `dense`'s dtype. Matrices whose outputs are compared rather than
  // summed on (`keep_int8`: the router's rows, lm_head) never go below INT8:
  // INT4's rounding would flip which experts a token gets and reorder the
  // vocabulary's close candidates.
  // `keep_int8` 2: the router's rows with --router-weights bf16: never
  // below bf16 (routing left exactly as the checkpoint computes it).
  auto linear_parts = [&](DenseW* dst, const std::vector<const Linear*>& parts, size_t pad_rows,
                          int keep_int8) -> Status {
    *dst = DenseW{};  // nothing of an earlier measuring pass (other dtype) survives
    const int cols = parts.front()->in;
    int rows = int(pad_rows);
    for (const Linear* p : parts) rows += p->out;
    dst->rows = rows;
    dst->cols = cols;
    // The parts' rows as bf16 bits in buf, zero rows after (uploads only).
    auto stack_rows = [&] {
      buf.clear();
      for (const Linear* p : parts) append_bf16_rows(*p, buf);
      buf.resize(dst->elems(), 0);
    };
    // The INT4 GEMV reads 32-input runs of a row, each inside one group, and
    // stages its input in shared memory: a width not a multiple of 32, or
    // too wide for 8 tokens' staging, goes to INT8 instead.
    if (dense == DenseDtype::int4 && !keep_int8 && cols % 32 == 0 &&
        cols <= cuda::dense_gemv_q4_max_k(cuda::kGemvMaxTokens)) {
      dequant_elems = std::max(dequant_elems, dst->elems());
      dst->q4m = q4_matrix_layout(rows, cols, kDenseQ4Group);
      auto* blob = c.take<uint8_t>(q4_matrix_bytes(dst->q4m));
      dst->q4 = blob;
      if (!upload) return {};
      stack_rows();
      std::vector<uint8_t> host(q4_matrix_bytes(dst->q4m));
      quantize_rows_q4_host(buf.data(), dst->q4m, host.data());
      MOE_CUDA_TRY(cudaMemcpy(blob, host.data(), host.size(), cudaMemcpyHostToDevice));
      return {};
    }
    // The INT8 GEMV reads 16-byte runs of a row: a width not a multiple of
    // 16 keeps that matrix in bf16.
    if (dense != DenseDtype::bf16 && keep_int8 != 2 && cols % 16 == 0) {
      dequant_elems = std::max(dequant_elems, dst->elems());
      auto* qd = c.take<int8_t>(dst->elems());
      auto* sd = c.take<float>(size_t(rows));
      dst->q = qd;
      dst->scale = sd;
      if (!upload) return {};
      stack_rows();
      std::vector<int8_t> qh(dst->elems());
      std::vector<float> sh(static_cast<size_t>(rows));
      quantize_rows_i8_host(buf.data(), rows, cols, qh.data(), sh.data());
      MOE_CUDA_TRY(cudaMemcpy(qd, qh.data(), qh.size(), cudaMemcpyHostToDevice));
      MOE_CUDA_TRY(cudaMemcpy(sd, sh.data(), sh.size() * 4, cudaMemcpyHostToDevice));
      return {};
    }
    bf16* wd = nullptr;
    if (!upload) {
      reserve(&wd, dst->elems());
      dst->w = wd;
      return {};
    }
    stack_rows();
    Status st = put(&wd, buf);
    dst->w = wd;
    return st;
  };
  auto linear = [&](DenseW* dst, std::initializer_list<const Linear*> parts, size_t pad_rows,
                    int keep_int8 = 0) -> Status {
    return linear_parts(dst, std::vector<const Linear*>(parts), pad_rows, keep_int8);
  };
  auto vec = [&](bf16** dst, const std::vector<float>& v) -> Status {
    if (v.empty()) {
      *dst = nullptr;
      return {};
    }
    if (!upload) {
      reserve(dst, v.size());
      return {};
    }
    return put(dst, bf16_of(v));
  };

  layers.resize(size_t(d.n_layers));
  for (int l = 0; l < d.n_layers; ++l) {
    const LayerWeights& lw = w.layers[size_t(l)];
    DevLayer& L = layers[size_t(l)];
    if (Status s = vec(&L.in_norm, lw.attn_norm); !s) return s;
    if (Status s = vec(&L.post_norm, lw.mlp_norm); !s) return s;
    if (Status s = linear(&L.qkv_w, {&lw.q, &lw.k, &lw.v}, 0); !s) return s;
    if (d.qkv_bias) {
      std::vector<float> b;
      for (const Linear* p : {&lw.q, &lw.k, &lw.v}) {
        if (p->bias.size() != size_t(p->out)) return make_error("layer " + std::to_string(l) + ": q/k/v bias missing");
        b.insert(b.end(), p->bias.begin(), p->bias.end());
      }
      if (Status s = vec(&L.qkv_b, b); !s) return s;
    }
    if (Status s = vec(&L.q_norm, lw.q_norm); !s) return s;
    if (Status s = vec(&L.k_norm, lw.k_norm); !s) return s;
    if (Status s = linear(&L.o_w, {&lw.o}, 0); !s) return s;
    L.moe_index = d.moe_layer_index(l);
    const Mlp* mlp = nullptr;
    if (L.moe_index >= 0) {
      if (lw.shared.gate.present()) mlp = &lw.shared;
      L.mlp_gated = lw.shared_gate.present();
    } else {
      mlp = &lw.dense;
    }
    if (mlp) {
      // One projection of the normed state: gate | up (| gate logit) (|
      // router logits), rows padded to 8 (16-byte aligned output rows).
      L.mlp_inter = mlp->gate.out;
      std::vector<const Linear*> parts = {&mlp->gate, &mlp->up};
      if (L.mlp_gated) parts.push_back(&lw.shared_gate);
      int rows = 2 * L.mlp_inter + (L.mlp_gated ? 1 : 0);
      if (L.moe_index >= 0) {
        L.router_row = rows;
        parts.push_back(&lw.router);
        rows += E;
      }
      L.mlp_rows = int(align_up(size_t(rows), 8));
      if (Status s = linear_parts(&L.mlp_gu_w, parts, size_t(L.mlp_rows - rows),
                                  L.router_row >= 0 ? (opts.router_bf16 ? 2 : 1) : 0);
          !s)
        return s;
      if (L.router_row >= 0) L.router_w = L.mlp_gu_w.slice(L.router_row, E);
      if (Status s = linear(&L.mlp_down_w, {&mlp->down}, 0); !s) return s;
    } else if (L.moe_index >= 0) {
      if (Status s = linear(&L.router_w, {&lw.router}, 0, opts.router_bf16 ? 2 : 1); !s) return s;
    }
  }
  // The embedding is gathered by row, never multiplied: it stays bf16. Under
  // a budget it may stay in host memory (embed_host): a step reads one row a
  // token over the link (4 KiB at hidden 2048), and its GiB or so of rows
  // become islands. Not when a bf16 lm_head shares it.
  if (embed_host) {
    if (upload) {
      const size_t bytes = size_t(w.embed.out) * w.embed.in * 2;
      if (!embed_host_buf)
        MOE_CUDA_TRY(cudaHostAlloc(reinterpret_cast<void**>(&embed_host_buf), bytes, cudaHostAllocMapped));
      buf.clear();
      append_bf16_rows(w.embed, buf);
      std::memcpy(static_cast<void*>(embed_host_buf), buf.data(), bytes);
      void* dp = nullptr;
      MOE_CUDA_TRY(cudaHostGetDevicePointer(&dp, embed_host_buf, 0));
      embed = static_cast<bf16*>(dp);
    }
  } else {
    const DenseDtype was = dense;
    dense = DenseDtype::bf16;
    DenseW e;
    if (Status s = linear(&e, {&w.embed}, 0); !s) return s;
    embed = const_cast<bf16*>(e.w);
    dense = was;
    if (d.tie_embeddings && dense == DenseDtype::bf16) {
      lm_head = e;
      head_is_embed = true;  // (the measuring carve's pointers are null: test this, not lm_head)
    }
  }
  if (Status s = vec(&final_norm, w.final_norm); !s) return s;
  if (!head_is_embed) {
    const size_t before = dequant_elems;  // lm_head runs as GEMVs only
    if (Status s = linear(&lm_head, {d.tie_embeddings ? &w.embed : &w.lm_head}, 0, 1); !s) return s;
    dequant_elems = before;
  }
  return {};
}

void CudaEngine::Impl::carve_workspace(Carver& c) {
  x = c.take<float>(size_t(T) * H);
  xn = c.take<bf16>(size_t(T) * H);
  qkv = c.take<float>(size_t(T) * W);
  q = c.take<bf16>(size_t(T) * QD);
  attn = c.take<bf16>(size_t(T) * QD);
  tmp = c.take<float>(size_t(T) * H);
  if (Lm > 0) {
    router_logits = c.take<float>(size_t(T) * E);
    route_w = c.take<float>(size_t(T) * K);
    route_ids = c.take<int32_t>(size_t(Lm) * T * K);
    h = c.take<float>(h_rows * size_t(layout.inter));
    blob_tables = c.take<const uint8_t*>(size_t(Lm) * E);
    if (grouped_ok) grouped_ws = c.take<uint8_t>(grouped_ws_bytes);
    hsum = c.take<float>(size_t(cuda::kGemvMaxTokens) * H);
    split_ids = c.take<int32_t>(size_t(cuda::kGemvMaxTokens) * K);
    on_gpu = c.take<uint8_t>(size_t(Lm) * E);
    share_rows = c.take<uint16_t>(size_t(kShareMaxTokens) * K + 1);
    share_split = c.take<int32_t>(size_t(kShareMaxTokens) * K);
    share_pass = c.take<uint32_t>(1);
    share_count = c.take<uint32_t>(size_t(Lm));
    share_ids = c.take<int32_t>(size_t(kShareMaxTokens) * K);
  }
  if (mlp_inter_max > 0) {
    gu = c.take<float>(size_t(T) * gu_stride);
    mh = c.take<bf16>(size_t(T) * mlp_inter_max);
  }
  xs = c.take<float>(size_t(kMaxSampleRows) * H);
  xsn = c.take<bf16>(size_t(kMaxSampleRows) * H);
  logits = c.take<float>(size_t(kMaxSampleRows) * V);
  sampled = c.take<int32_t>(kMaxSampleRows);
  inv_freq = c.take<float>(size_t(d.head_dim / 2));
  pack_dev = c.take<uint8_t>(pack_bytes);
  dequant = dense != DenseDtype::bf16 ? c.take<bf16>(dequant_elems) : nullptr;
}

// Lets go of the process' pages of a mapped range it has read (a file
// mapping: they stay in the page cache, reclaimable, and fault back in if
// touched again), so that reading a checkpoint does not add it to the RSS.
static void release_mapped(const void* p, size_t n) {
  if (!p || n == 0) return;
  const uintptr_t page = uintptr_t(sysconf(_SC_PAGESIZE));
  const uintptr_t lo = uintptr_t(p) / page * page, hi = (uintptr_t(p) + n + page - 1) / page * page;
  (void)::madvise(reinterpret_cast<void*>(lo), hi - lo, MADV_DONTNEED);
}

Status CudaEngine::Impl::expert_source(ExpertHostSource& src) {
  src.n_layers = Lm;
  src.n_experts = E;
  src.blob_bytes = layout.blob_bytes;
  src.blobs.resize(size_t(Lm) * E);
  if (host_weights->experts_q4) {
    for (int l = 0; l < d.n_layers; ++l)
      if (const int ml = d.moe_layer_index(l); ml >= 0)
        for (int e = 0; e < E; ++e) src.blobs[size_t(ml) * E + e] = host_weights->layers[size_t(l)].experts[size_t(e)].q4;
    return {};
  }
  // A checkpoint with float experts: quantised now, on every core, into one
  // page-locked block for all of them (the arena uses it where it lies, no
  // second copy); each layer's float pages are let go once read, so the host
  // holds the INT4 experts and about one layer of the float model at a time.
  const size_t total = size_t(Lm) * E * layout.blob_bytes;
  MOE_CUDA_TRY(cudaHostAlloc(reinterpret_cast<void**>(&pinned_experts), total,
                             cudaHostAllocPortable | cudaHostAllocMapped));
  src.pinned_base = pinned_experts;
  const unsigned threads = std::max(1u, std::thread::hardware_concurrency());
  const auto t0 = std::chrono::steady_clock::now();
  double last_said = -10;
  int done_layers = 0;
  for (int l = 0; l < d.n_layers; ++l) {
    const int ml = d.moe_layer_index(l);
    if (ml < 0) continue;
    const LayerWeights& lw = host_weights->layers[size_t(l)];
    std::atomic<int> next{0};
    auto work = [&] {
      std::vector<float> g;
      for (int e = next++; e < E; e = next++) {
        const Mlp& m = lw.experts[size_t(e)];
        uint8_t* blob = pinned_experts + (size_t(ml) * E + e) * layout.blob_bytes;
        std::memset(blob, 0, layout.blob_bytes);
        for (auto [lin, ml_layout] : {std::pair{&m.gate, &layout.gate}, std::pair{&m.up, &layout.up},
                                      std::pair{&m.down, &layout.down}}) {
          g.resize(size_t(lin->out) * lin->in);
          for (int row = 0; row < lin->out; ++row) lin->row(row, g.data() + size_t(row) * lin->in);
          q4_quantize_matrix(g.data(), *ml_layout, blob);
          release_mapped(lin->bf16 ? static_cast<const void*>(lin->bf16) : lin->f32,
                         size_t(lin->out) * lin->in * (lin->bf16 ? 2 : 4));
        }
        src.blobs[size_t(ml) * E + e] = blob;
      }
    };
    std::vector<std::thread> team;
    for (unsigned t = 1; t < threads; ++t) team.emplace_back(work);
    work();
    for (auto& t : team) t.join();
    ++done_layers;
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (s - last_said >= 2.0 || done_layers == Lm) {
      last_said = s;
      std::fprintf(stderr, "moe-worker: experts to INT4 (group %d): %d of %d layers (%d %%), %.1f s\n",
                   layout.group, done_layers, Lm, done_layers * 100 / Lm, s);
    }
  }
  return {};
}

// ---------------------------------------------------------------- creation

Result<std::string> cuda_device_summary() {
  // Nothing here makes a context: what the process holds is measured before
  // one exists (CudaEngine::create).
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) return make_error("no CUDA device");
  int dev = 0;
  MOE_CUDA_TRY(cudaGetDevice(&dev));
  cudaDeviceProp prop{};
  MOE_CUDA_TRY(cudaGetDeviceProperties(&prop, dev));
  return std::string(prop.name) + " (sm_" + std::to_string(prop.major) + std::to_string(prop.minor) + ", " +
         format_bytes(prop.totalGlobalMem) + ")";
}

Result<std::unique_ptr<CudaEngine>> CudaEngine::create(std::shared_ptr<ModelFiles> files,
                                                       const CudaEngineOptions& opts) {
  auto dev = cuda_device_summary();
  if (!dev) return make_error("the cuda backend needs a CUDA device: " + dev.error());
  const ModelDesc& d = files->desc();
  if (d.attention != AttentionKind::gqa)
    return make_error(std::string("the cuda backend does not run ") + arch_name(d.arch) +
                      " (multi-head latent attention); use --backend cpu");
  if (d.moe.topk_method != "greedy")
    return make_error("the cuda backend has no group-limited expert selection (" + d.moe.topk_method + ")");
  if (opts.max_step_tokens < 1 || opts.max_step_tokens > 8192)
    return make_error("max_step_tokens must be in [1, 8192]");
  if (opts.misses != "stream" && opts.misses != "copy")
    return make_error("misses must be stream or copy, got '" + opts.misses + "'");
  if (opts.fuse_max_tokens < 0 || opts.fuse_max_tokens > cuda::kGemvMaxTokens)
    return make_error("fuse_max_tokens must be in [0, 8]");

  std::unique_ptr<CudaEngine> eng(new CudaEngine());
  eng->impl_ = std::make_unique<Impl>();
  Impl& m = *eng->impl_;
  m.files = std::move(files);
  m.d = d;
  m.opts = opts;
  m.H = d.hidden_size;
  m.QD = d.n_heads * d.head_dim;
  m.W = (d.n_heads + 2 * d.n_kv_heads) * d.head_dim;
  m.E = d.moe.n_experts;
  m.K = d.moe.top_k;
  m.Lm = d.n_moe_layers();
  m.V = d.vocab_size;
  m.T = opts.max_step_tokens;
  m.max_context = opts.max_context > 0 ? opts.max_context : std::min(d.max_position > 0 ? d.max_position : 4096, 32768);
  m.max_blocks = (m.max_context + kBlockTokens - 1) / kBlockTokens;

  auto w = load_weights(*m.files, /*convert_f32=*/false, /*use_q4=*/m.files->experts_q4());
  if (!w) return make_error(w.error());
  m.host_weights = std::move(*w);
  if (m.Lm > 0) {
    m.layout = m.host_weights->experts_q4 ? m.host_weights->q4_layout
                                          : expert_layout(m.H, d.moe.expert_intermediate, opts.q4_group);
    m.grouped_ok = cuda::q4_grouped_supported(m.layout);
    m.h_rows = size_t(m.grouped_ok ? std::min(m.T, cuda::kGemvMaxTokens) : m.T) * m.K;
    if (m.grouped_ok) m.grouped_ws_bytes = cuda::q4_grouped_workspace_bytes(m.layout, m.T, m.K, m.E);
  }
  for (int l = 0; l < d.n_layers; ++l) {
    const LayerWeights& lw = m.host_weights->layers[size_t(l)];
    const Mlp* mlp = d.moe_layer_index(l) >= 0 ? (lw.shared.gate.present() ? &lw.shared : nullptr) : &lw.dense;
    if (!mlp) continue;
    m.mlp_inter_max = std::max(m.mlp_inter_max, mlp->gate.out);
    const int rows = 2 * mlp->gate.out + (lw.shared_gate.present() ? 1 : 0) + (d.moe_layer_index(l) >= 0 ? m.E : 0);
    m.gu_stride = std::max(m.gu_stride, int(align_up(size_t(rows), 8)));
  }
  m.pack_bytes = m.pack_layout(m.T, kMaxSampleRows, m.T).bytes;

  // The budget is the whole process's, as nvidia-smi shows it: first what
  // the process holds without the arena (the context with its modules, the
  // stream, cuBLASLt's handle and workspace), measured; the arena gets the
  // rest, less a reserve for the CUDA graphs instantiated later.
  int dev_index = 0;
  MOE_CUDA_TRY(cudaGetDevice(&dev_index));
  char bus[32] = {};
  MOE_CUDA_TRY(cudaDeviceGetPCIBusId(bus, int(sizeof(bus)), dev_index));
  auto meter = DeviceMemoryMeter::open(bus);
  std::optional<uint64_t> used_before;
  if (meter) {
    if (auto u = (*meter)->device_used_bytes()) used_before = *u;
  }
  MOE_CUDA_TRY(cudaFree(nullptr));  // the context, now
  MOE_CUDA_TRY(cudaStreamCreateWithFlags(&m.st, cudaStreamNonBlocking));
  MOE_CUDA_TRY(cudaEventCreateWithFlags(&m.routes_ready, cudaEventDisableTiming));
  {
    auto cm = cuda::CublasLtMatmul::create();
    if (!cm) return make_error(cm.error());
    m.mm.reset(cm.value());
  }
  MOE_CUDA_TRY(cudaDeviceSynchronize());
  size_t free_b = 0, total_b = 0;
  MOE_CUDA_TRY(cudaMemGetInfo(&free_b, &total_b));
  // This process in NVML's list, else the device's use since before the
  // context (nothing else runs on a worker's device), else a fixed guess.
  std::string held_how;
  if (meter) {
    if (auto b = (*meter)->process_bytes()) {
      m.base_device_bytes = *b;
      held_how = "as NVML lists this process";
    } else if (used_before) {
      if (auto u = (*meter)->device_used_bytes(); u && *u >= *used_before) {
        m.base_device_bytes = *u - *used_before;
        held_how = "the device's use since before the context";
      }
    }
  }
  if (held_how.empty()) {
    m.base_device_bytes = kContextGuess;
    held_how = std::string("a guess: ") + (meter ? "NVML does not list this process" : meter.error());
  }
  m.meter = meter ? std::move(*meter) : nullptr;
  size_t budget = opts.vram_budget ? opts.vram_budget
                                   : (free_b > kDefaultMargin ? free_b - kDefaultMargin + m.base_device_bytes : 0);
  if (opts.arena_budget) budget = opts.arena_budget + m.base_device_bytes + kGraphReserve;
  if (!opts.arena_budget && opts.vram_budget && budget > free_b + m.base_device_bytes)
    return make_error("--vram-budget " + format_bytes(budget) + " exceeds what the device has for this process (" +
                      format_bytes(free_b + m.base_device_bytes) + ")");
  // Nothing left for the arena at all: said here; too little for the model
  // is the plan's to say (with what would fit).
  if (budget <= m.base_device_bytes + kGraphReserve)
    return make_error("--vram-budget " + format_bytes(budget) + " leaves nothing for the model: the CUDA context and "
                      "libraries hold " + format_bytes(m.base_device_bytes) + " (" + held_how + "), and " +
                      format_bytes(kGraphReserve) + " is kept for CUDA graphs; the model's own part needs more (a "
                      "larger budget says how much)");
  m.budget_bytes = budget;
  const size_t arena_budget = budget - m.base_device_bytes - kGraphReserve;
  std::fprintf(stderr, "moe-worker: the budget %s holds the CUDA context and libraries, %s (%s), %s kept for CUDA "
               "graphs, and an arena of at most %s\n", format_bytes(budget).c_str(),
               format_bytes(m.base_device_bytes).c_str(), held_how.c_str(), format_bytes(kGraphReserve).c_str(),
               format_bytes(arena_budget).c_str());
  if (opts.dense_weights != "auto" && opts.dense_weights != "bf16" && opts.dense_weights != "int8" &&
      opts.dense_weights != "int4")
    return make_error("dense weights must be auto, bf16, int8 or int4, not '" + opts.dense_weights + "'");
  if (opts.host_experts != "auto" && opts.host_experts != "on" && opts.host_experts != "off")
    return make_error("host experts must be auto, on or off, not '" + opts.host_experts + "'");
  auto plan_for = [&](DenseDtype dt) -> Result<IslandPlan> {
    m.dense = dt;
    m.dequant_elems = 0;
    Carver measure_w, measure_ws;
    if (Status s = m.carve_weights(measure_w, false); !s) return make_error(s.error());
    m.carve_workspace(measure_ws);
    IslandPlanRequest req;
    req.budget_bytes = arena_budget;
    req.nonexpert_bytes = measure_w.used;
    req.workspace_bytes = measure_ws.used;
    req.kv_bytes_per_block = size_t(2) * d.n_layers * kBlockTokens * d.n_kv_heads * d.head_dim * 2;
    // Blocks the operator asked for are exactly what the pool gets.
    req.kv_blocks_min = opts.kv_blocks > 0 ? opts.kv_blocks : std::max(opts.kv_blocks_min, 1);
    req.kv_blocks_wanted = req.kv_blocks_min;
    req.expert_blob_bytes = m.Lm > 0 ? m.layout.blob_bytes : kAlign;
    req.n_total_experts = int64_t(m.Lm) * m.E;
    req.min_islands = m.Lm > 0 ? m.E : 0;  // a prompt may route to every expert of a layer at once
    auto plan = plan_islands(req);
    if (!plan) return make_error(plan.error());
    if (opts.kv_blocks == 0) {
      // Unasked, KV takes what the experts leave, up to 8 GiB.
      const size_t left = req.budget_bytes - plan->arena_bytes;
      const int64_t extra = int64_t(std::min(left, size_t(8) << 30) / plan->kv_block_stride);
      if (extra > 0) {
        req.kv_blocks_wanted = plan->kv_blocks + extra;
        plan = plan_islands(req);
      }
    }
    return plan;
  };
  const int64_t all_experts = int64_t(m.Lm) * m.E;
  // A plan in one dtype. Under a budget the embedding may stay in host
  // memory, its bytes going to islands (not when a bf16 lm_head shares it).
  auto plan_dtype = [&](DenseDtype dt) -> Result<IslandPlan> {
    m.embed_host = false;
    auto p = plan_for(dt);
    const bool embed_may_leave = !(d.tie_embeddings && dt == DenseDtype::bf16);
    if (opts.host_embedding && embed_may_leave && m.Lm > 0 && !(p && p->n_islands >= all_experts)) {
      m.embed_host = true;
      auto ph = plan_for(dt);
      if (ph && (!p || ph->n_islands > p->n_islands)) return ph;
      m.embed_host = false;  // the measure's other results do not depend on it
    }
    return p;
  };
  // auto: bf16 when it leaves every expert resident, else INT8. Never INT4
  // unless asked: on the demo model's held-out text INT4 attention moves
  // 3.6 % of the top-k routing choices and perplexity by 0.8 %, INT8 0.56 %
  // and 0.02 % (bench/results/gpu-quality-2026-12-02.txt), for 3.5 % more
  // islands (the Qwen3-30B shape at 12 GiB).
  DenseDtype chosen = DenseDtype::bf16;
  if (opts.dense_weights == "int8") chosen = DenseDtype::int8;
  if (opts.dense_weights == "int4") chosen = DenseDtype::int4;
  if (opts.dense_weights == "auto") {
    Result<IslandPlan> best = make_error("no plan");
    for (DenseDtype dt : {DenseDtype::bf16, DenseDtype::int8}) {
      auto p = plan_dtype(dt);
      // With no plan at all, the narrowest dtype's refusal is the one to show.
      if (!best || (p && p->n_islands > best->n_islands)) {
        best = std::move(p);
        chosen = dt;
      }
      if (best && best->n_islands >= all_experts) break;
    }
    // INT4 only when INT8 leaves no room at all (it says so at start).
    if (!best) {
      if (auto p = plan_dtype(DenseDtype::int4)) {
        chosen = DenseDtype::int4;
        std::fprintf(stderr, "moe-worker: INT8 non-expert weights leave no room in this budget; INT4 instead "
                             "(about 0.8 %% perplexity, docs/cuda-worker.md)\n");
      }
    }
  }
  // Measured again for the chosen dtype: the upload carve follows this one.
  Result<IslandPlan> plan = plan_dtype(chosen);
  if (!plan) return make_error(plan.error());
  m.plan = *plan;
  m.kv_blocks = int(std::min<int64_t>(m.plan.kv_blocks, INT32_MAX));
  m.all_resident = m.Lm == 0 || m.plan.n_islands >= int64_t(m.Lm) * m.E;

  ExpertHostSource src;
  if (m.Lm > 0) {
    if (Status s = m.expert_source(src); !s) return make_error(s.error());
  } else {
    // A dense model: the arena still needs a source; one dummy layer.
    src.n_layers = 1;
    src.n_experts = 1;
    src.blob_bytes = kAlign;
    static const uint8_t zero[kAlign] = {};
    src.blobs = {zero};
  }
  auto arena = IslandArena::create(m.plan, src);
  if (!arena) return make_error(arena.error());
  m.arena = std::move(*arena);

  Carver cw{m.arena->region(m.plan.nonexpert)};
  if (Status s = m.carve_weights(cw, true); !s) return make_error(s.error());
  Carver cs{m.arena->region(m.plan.workspace)};
  m.carve_workspace(cs);
  // KV: per layer a K and a V pool of kv_blocks blocks.
  const size_t pool_bytes = size_t(m.kv_blocks) * kBlockTokens * d.n_kv_heads * d.head_dim * 2;
  uint8_t* kv = m.arena->region(m.plan.kv);
  for (int l = 0; l < d.n_layers; ++l) {
    m.layers[size_t(l)].k_pool = reinterpret_cast<bf16*>(kv + size_t(2 * l) * pool_bytes);
    m.layers[size_t(l)].v_pool = reinterpret_cast<bf16*>(kv + size_t(2 * l + 1) * pool_bytes);
  }
  m.free_blocks.reserve(size_t(m.kv_blocks));
  for (int b = m.kv_blocks - 1; b >= 0; --b) m.free_blocks.push_back(b);

  // RoPE table, as the CPU engine computes it.
  {
    const std::vector<float> inv = rope_frequencies(d, &m.attention_factor);
    MOE_CUDA_TRY(cudaMemcpy(m.inv_freq, inv.data(), inv.size() * 4, cudaMemcpyHostToDevice));
  }

  MOE_CUDA_TRY(cudaMallocHost(reinterpret_cast<void**>(&m.pack_host), m.pack_bytes));
  MOE_CUDA_TRY(cudaMallocHost(reinterpret_cast<void**>(&m.sampled_host), kMaxSampleRows * 4));
  MOE_CUDA_TRY(cudaMallocHost(reinterpret_cast<void**>(&m.logits_host), size_t(kMaxSampleRows) * m.V * 4));
  if (m.Lm > 0) {
    MOE_CUDA_TRY(cudaMallocHost(reinterpret_cast<void**>(&m.tables_host), size_t(m.Lm) * m.E * sizeof(void*)));
    MOE_CUDA_TRY(cudaMallocHost(reinterpret_cast<void**>(&m.ids_host), size_t(m.Lm) * m.T * m.K * 4));
    std::memset(m.tables_host, 0, size_t(m.Lm) * m.E * sizeof(void*));
    std::unique_ptr<EvictionPolicy> pol;
    if (opts.policy == "lru") pol = std::make_unique<LruPolicy>();
    else if (opts.policy == "lfu") pol = std::make_unique<LfuDecayPolicy>();
    else if (opts.policy == "ours") pol = std::make_unique<OursPolicy>();
    else return make_error("unknown eviction policy '" + opts.policy + "' (lru, lfu, ours)");
    m.map = std::make_unique<ResidencyMap>(m.Lm, m.E, m.plan.n_islands, m.layout.blob_bytes, std::move(pol));
    m.predictor = std::make_unique<ExpertPredictor>(m.Lm, m.E);
    m.bound.resize(size_t(m.Lm));
    MOE_CUDA_TRY(cudaMallocHost(reinterpret_cast<void**>(&m.on_gpu_host), size_t(m.Lm) * m.E));
    if (!m.all_resident && opts.host_experts != "off") {
      // Copy mode splits a layer's misses on the host's clock; streamed
      // passes hand the host its share through mapped memory.
      if (Status s = opts.misses == "copy" ? m.start_host_experts() : m.start_host_share(); !s)
        return make_error(s.error());
    }
    if (m.all_resident) {
      // Every expert into its island now; the pointer tables never change.
      for (int ml = 0; ml < m.Lm; ++ml)
        for (int e = 0; e < m.E; ++e) {
          auto p = m.arena->request(*m.map, ml, e, m.st);
          if (!p) return make_error(p.error());
          m.tables_host[size_t(ml) * m.E + e] = *p;
          if (Status s = m.arena->release(*m.map, ml, e, m.st); !s) return make_error(s.error());
        }
      MOE_CUDA_TRY(cudaMemcpyAsync(m.blob_tables, m.tables_host, size_t(m.Lm) * m.E * sizeof(void*),
                                   cudaMemcpyHostToDevice, m.st));
      ++m.residency_version;
    }
  }
  if (Status s = m.arena->synchronize(); !s) return make_error(s.error());
  MOE_CUDA_TRY(cudaStreamSynchronize(m.st));
  if (m.meter) (void)eng->device_memory();  // the peak starts at the ready state
  std::fprintf(stderr, "moe-worker: cuda backend on %s; %s; dense weights %s%s; experts %s\n", dev->c_str(),
               m.plan.describe().c_str(), dense_name(m.dense),
               m.embed_host ? ", embedding in host memory" : "",
               m.all_resident ? "all resident" : "under the budget (islands < experts)");
  return Result<std::unique_ptr<CudaEngine>>(std::move(eng));
}

CudaEngine::~CudaEngine() = default;

// ---------------------------------------------------------------- the forward pass

Status CudaEngine::Impl::bind_experts(int ml, int n, const std::function<Status()>& meanwhile) {
  // The host needs the layer's routes to know what to fetch.
  const int32_t* ids_dev = route_ids + size_t(ml) * n * K;
  int32_t* ids = ids_host + size_t(ml) * n * K;
  MOE_CUDA_TRY(cudaMemcpyAsync(ids, ids_dev, size_t(n) * K * 4, cudaMemcpyDeviceToHost, st));
  const bool may_split = host_x && n <= cuda::kGemvMaxTokens;
  if (may_split) {  // what the host needs to compute experts itself, in the same wait
    MOE_CUDA_TRY(cudaMemcpyAsync(xn_host, xn, size_t(n) * H * sizeof(bf16), cudaMemcpyDeviceToHost, st));
    MOE_CUDA_TRY(cudaMemcpyAsync(rw_host, route_w, size_t(n) * K * 4, cudaMemcpyDeviceToHost, st));
  }
  MOE_CUDA_TRY(cudaEventRecord(routes_ready, st));
  if (Status s = meanwhile(); !s) return s;
  MOE_CUDA_TRY(cudaEventSynchronize(routes_ready));
  stream_tables_stale = true;  // this pass moves experts without the streamed tables
  // bound[ml] lists exactly the experts pinned so far, so that a failure at
  // any point after can be undone by release_experts.
  std::vector<int>& pinned = bound[size_t(ml)];
  pinned.clear();
  std::vector<int> used = distinct_experts(ids, n * K, E);
  host_pairs.clear();
  if (may_split) {
    // Misses (neither resident nor on their way) split between the link and
    // the host so that both finish about together.
    std::vector<MissCost> misses;
    for (int e : used)
      if (map->lookup({ml, e}) < 0) misses.push_back({e, int(std::count(ids, ids + size_t(n) * K, e))});
    const std::vector<int> on_host =
        misses.size() < 2 ? std::vector<int>{} : plan_split(misses, link_us, host_us_token, kHostFixedUs);
    if (!on_host.empty()) {
      for (int i = 0; i < n * K; ++i) {
        const bool host = std::find(on_host.begin(), on_host.end(), ids[i]) != on_host.end();
        split_ids_host[i] = host ? -1 : ids[i];
        if (host) host_pairs.push_back({i / K, arena->host_blob({ml, ids[i]}), rw_host[i]});
      }
      MOE_CUDA_TRY(cudaMemcpyAsync(split_ids, split_ids_host, size_t(n) * K * 4, cudaMemcpyHostToDevice, st));
      std::erase_if(used, [&](int e) { return std::find(on_host.begin(), on_host.end(), e) != on_host.end(); });
      host_experts_served += on_host.size();
      host_expert_tokens += host_pairs.size();
    }
  }
  const uint8_t** table = tables_host + size_t(ml) * E;
  for (int e : used) {
    auto p = arena->request(*map, ml, e, st);
    if (!p) return make_error(p.error());
    table[e] = *p;
    pinned.push_back(e);
  }
  map->clear_predictions(ml);
  MOE_CUDA_TRY(cudaMemcpyAsync(blob_tables + size_t(ml) * E, table, size_t(E) * sizeof(void*), cudaMemcpyHostToDevice,
                               st));
  if (!opts.prefetch) return {};
  static_assert(std::is_same_v<int32_t, int>, "the predictor reads the ids in place");
  auto row = [&](int t) { return std::span<const int>(ids + size_t(t) * K, size_t(K)); };
  for (int t = 0; t < n; ++t) predictor->observe(ml, row(t));
  if (Lm < 2) return {};  // the next layer would be this one, in use
  // A pass this large uses (nearly) every expert of a layer whatever the
  // routing: an expert is left out with chance (1 - 1/E)^(nK) < e^-4 once
  // nK >= 4E (a prompt). Queue all of the next layer's experts behind this
  // layer's misses, so the link keeps moving while this layer computes.
  if (size_t(n) * K >= 4 * size_t(E)) {
    std::vector<int> all(static_cast<size_t>(E));
    std::iota(all.begin(), all.end(), 0);
    return arena->prefetch(*map, (ml + 1) % Lm, all, HintPriority::prefetch);
  }
  // The next MoE layer's likely experts, copied while this one computes.
  std::vector<int> guess;
  for (int t = 0; t < n; ++t)
    for (int e : predictor->predict_next(ml, row(t)))
      if (std::find(guess.begin(), guess.end(), e) == guess.end()) guess.push_back(e);
  if (guess.empty()) return {};
  return arena->prefetch(*map, (ml + 1) % Lm, guess, HintPriority::prefetch);
}

// One expert blob over the link, µs (the best of four copies into island 0,
// which is still empty when this runs); opts.host_link_us overrides it.
Result<double> CudaEngine::Impl::measure_link_us() {
  if (opts.host_link_us > 0) return opts.host_link_us;
  const uint8_t* blob = arena->host_blob({0, 0});
  // Timing events, destroyed on every way out.
  struct Events {
    cudaEvent_t a = nullptr, b = nullptr;
    ~Events() {
      if (a) (void)cudaEventDestroy(a);
      if (b) (void)cudaEventDestroy(b);
    }
  } ev;
  MOE_CUDA_TRY(cudaEventCreate(&ev.a));
  MOE_CUDA_TRY(cudaEventCreate(&ev.b));
  float best = 1e30f;
  for (int i = 0; i < 4; ++i) {
    MOE_CUDA_TRY(cudaEventRecord(ev.a, st));
    MOE_CUDA_TRY(cudaMemcpyAsync(arena->island(0), blob, layout.blob_bytes, cudaMemcpyHostToDevice, st));
    MOE_CUDA_TRY(cudaEventRecord(ev.b, st));
    MOE_CUDA_TRY(cudaEventSynchronize(ev.b));
    float ms = 0;
    MOE_CUDA_TRY(cudaEventElapsedTime(&ms, ev.a, ev.b));
    best = std::min(best, ms);
  }
  return double(best) * 1000.0;
}

// Streamed decode passes under a budget: the host's cores take a share of
// each layer's misses (as many as finish no later than the link would with
// the rest, by the two rates measured here, fixed for the process so that
// its outputs do not follow timings).
Status CudaEngine::Impl::start_host_share() {
  const int hw = int(std::thread::hardware_concurrency());
  // Every core but two: the step thread's, which waits on the device
  // meanwhile, and one for the rest of the system (the team spins; a
  // descheduled member holds up every phase).
  const int threads = opts.host_threads > 0 ? opts.host_threads : hw - 2;
  if (threads < 2 || K > kShareMaxTopK) return {};
  const size_t slots = align_up(size_t(Lm) * sizeof(ShareSlot), 256);
  const size_t xs = align_up(size_t(Lm) * kShareMaxTokens * H * sizeof(bf16), 256);
  const size_t bytes = slots + xs + size_t(Lm) * kShareMaxTokens * H * sizeof(float);
  MOE_CUDA_TRY(cudaHostAlloc(reinterpret_cast<void**>(&share_host), bytes, cudaHostAllocMapped));
  std::memset(share_host, 0, bytes);
  uint8_t* dev = nullptr;
  MOE_CUDA_TRY(cudaHostGetDevicePointer(reinterpret_cast<void**>(&dev), share_host, 0));
  share_slots_dev = reinterpret_cast<ShareSlot*>(dev);
  share_x_dev = reinterpret_cast<bf16*>(dev + slots);
  share_sum_dev = reinterpret_cast<float*>(dev + slots + xs);
  MOE_CUDA_TRY(cudaMallocHost(reinterpret_cast<void**>(&pass_host), sizeof(uint32_t)));
  std::vector<const uint8_t*> blobs(size_t(Lm) * E);
  for (int ml = 0; ml < Lm; ++ml)
    for (int e = 0; e < E; ++e) blobs[size_t(ml) * E + e] = arena->host_blob({ml, e});
  const ShareMemory mem{reinterpret_cast<ShareSlot*>(share_host), reinterpret_cast<uint16_t*>(share_host + slots),
                        reinterpret_cast<float*>(share_host + slots + xs)};
  share = std::make_unique<HostShare>(layout, Lm, E, std::move(blobs), mem, threads);
  // The least of three measures a tenth of a second apart: the table stands
  // for the process's life, and the system may be busy just then (on the
  // GPU machine a measure right after another engine let go of its pinned
  // experts once took 6 ms an expert against 120-170 us).
  double host_us = opts.host_expert_us;
  if (host_us <= 0) {
    host_us = share->measure_us();
    for (int i = 1; i < 3; ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
      host_us = std::min(host_us, share->measure_us());
    }
  }
  auto link = measure_link_us();
  if (!link) return make_error(link.error());
  link_us = *link;
  // Row steps of whole down-projection groups and of the host's 64-input runs.
  const int step = std::lcm(64, layout.down.group);
  const std::vector<uint16_t> rows =
      share_rows_table(kShareMaxTokens * K, layout.inter, step, link_us, host_us, kShareFixedUs);
  if (opts.host_experts == "auto" && std::all_of(rows.begin(), rows.end(), [](uint16_t r) { return r == 0; })) {
    share.reset();  // the link alone is as quick: no team spinning for nothing
    for (void* p : {static_cast<void*>(share_host), static_cast<void*>(pass_host)}) (void)cudaFreeHost(p);
    share_host = nullptr;
    pass_host = nullptr;
    std::fprintf(stderr,
                 "moe-worker: streamed misses stay on the link (%.0f us an expert; the host's %d threads %.0f us)\n",
                 link_us, threads, host_us);
    return {};
  }
  MOE_CUDA_TRY(cudaMemcpy(share_rows, rows.data(), rows.size() * sizeof(uint16_t), cudaMemcpyHostToDevice));
  std::string t;
  for (size_t m = 1; m <= size_t(K); ++m) {
    if (m > 1) t += ' ';
    t += std::to_string(rows[m]);
  }
  std::fprintf(stderr,
               "moe-worker: streamed misses shared with %d host threads (%.0f us an expert; the link %.0f us): with "
               "1..%d missed pairs a layer the host computes the first %s of each one's %d rows\n",
               share->threads(), host_us, link_us, K, t.c_str(), layout.inter);
  return {};
}

// Under a budget: a pool for misses computed on the host, and the two rates
// the split weighs, measured here (this machine's link and cores, not a
// guess). Islands are still empty, so island 0 takes the timing copies.
Status CudaEngine::Impl::start_host_experts() {
  const int hw = int(std::thread::hardware_concurrency());
  const int threads = opts.host_threads > 0 ? opts.host_threads : hw;
  if (threads < 2) return {};  // one core: it has the step to drive
  host_x = std::make_unique<HostExperts>(layout, threads);
  MOE_CUDA_TRY(cudaMallocHost(reinterpret_cast<void**>(&xn_host), size_t(cuda::kGemvMaxTokens) * H * sizeof(bf16)));
  MOE_CUDA_TRY(cudaMallocHost(reinterpret_cast<void**>(&rw_host), size_t(cuda::kGemvMaxTokens) * K * 4));
  MOE_CUDA_TRY(cudaMallocHost(reinterpret_cast<void**>(&hsum_host), size_t(cuda::kGemvMaxTokens) * H * 4));
  MOE_CUDA_TRY(cudaMallocHost(reinterpret_cast<void**>(&split_ids_host), size_t(cuda::kGemvMaxTokens) * K * 4));
  // Experts spread over the layers: each timing run reads memory, as a miss does.
  std::vector<const uint8_t*> blobs;
  for (int i = 0; i < 16; ++i) blobs.push_back(arena->host_blob({(i * 7) % Lm, (i * 13) % E}));
  host_us_token = host_x->measure_us(blobs);
  auto link = measure_link_us();
  if (!link) return make_error(link.error());
  link_us = *link;
  std::fprintf(stderr,
               "moe-worker: misses split between the link (%.0f us an expert) and %d host threads (%.0f us an "
               "expert-token)\n",
               link_us, host_x->threads(), host_us_token);
  return {};
}

Status CudaEngine::Impl::upload_stream_tables() {
  const size_t entries = size_t(Lm) * E;
  for (int ml = 0; ml < Lm; ++ml)
    for (int e = 0; e < E; ++e) {
      const int64_t i = map->lookup({ml, e});
      on_gpu_host[size_t(ml) * E + e] = i >= 0 && tables_host[size_t(ml) * E + e] == arena->island(i);
    }
  MOE_CUDA_TRY(cudaMemcpyAsync(blob_tables, tables_host, entries * sizeof(void*), cudaMemcpyHostToDevice, st));
  MOE_CUDA_TRY(cudaMemcpyAsync(on_gpu, on_gpu_host, entries, cudaMemcpyHostToDevice, st));
  return {};
}

Status CudaEngine::Impl::prepare_streamed_pass() {
  bool changed = false;
  if (stream_tables_stale) {
    // After copy-mode passes, warms or unloads: every copy they started has
    // landed, then each entry is its island or its host blob.
    if (Status s = arena->synchronize(); !s) return s;
    for (int ml = 0; ml < Lm; ++ml)
      for (int e = 0; e < E; ++e) {
        const int64_t i = map->lookup({ml, e});
        tables_host[size_t(ml) * E + e] = i >= 0 ? arena->island(i) : arena->host_blob_on_device({ml, e});
      }
    admitted.clear();
    landing.clear();
    stream_tables_stale = false;
    changed = true;
  } else {
    // Copies started two passes ago have had a whole pass to land (a few
    // experts, ~50 us each): the pass waits for them, normally not at all,
    // and reads them from their islands. The last pass's admissions keep
    // streaming for one more pass, so a pass never waits on a fresh copy.
    for (const Landing& a : landing) {
      if (map->lookup(a.key) != a.island) continue;  // evicted again meanwhile
      if (Status s = arena->wait_copied(a.island, st); !s) return s;
      tables_host[size_t(a.key.layer) * E + a.key.expert] = arena->island(a.island);
      changed = true;
    }
    landing.swap(admitted);
    admitted.clear();
  }
  return changed ? upload_stream_tables() : Status{};
}

Status CudaEngine::Impl::after_streamed_pass(int n) {
  // ids_host holds every layer's routes of the pass. An expert was a hit
  // when the pass read it from an island.
  std::vector<ExpertKey> streamed;
  int missed = 0;
  for (int ml = 0; ml < Lm; ++ml) {
    const std::vector<int> used = distinct_experts(ids_host + size_t(ml) * n * K, n * K, E);
    const std::vector<int32_t>* host = sharing ? &share->taken(ml) : nullptr;
    for (int e : used) {
      const ExpertKey key{ml, e};
      const int64_t i = map->lookup(key);
      using Served = ResidencyMap::Served;
      Served how = Served::streamed;
      if (i >= 0 && tables_host[size_t(ml) * E + e] == arena->island(i))
        how = Served::island;
      else if (host && std::find(host->begin(), host->end(), e) != host->end())
        how = Served::host;
      map->note_use(key, how);
      if (how == Served::island) continue;
      ++missed;
      if (how == Served::streamed) bytes_streamed += layout.blob_bytes;
      if (how == Served::host)  // the rows the host left streamed
        bytes_streamed += layout.blob_bytes * size_t(layout.inter - share->taken_rows(ml)) / size_t(layout.inter);
      if (i < 0) streamed.push_back(key);
    }
  }
  if (n <= kShareMaxTokens) share_misses[size_t(n)] = 0.9 * share_misses[size_t(n)] + 0.1 * double(missed) / double(Lm);
  // The streamed experts the policy finds worth an island, copied in now;
  // an evicted expert streams from the next pass on.
  int budget = opts.stream_admit_per_pass;
  for (const ExpertKey& key : streamed) {
    if (budget <= 0) break;
    const std::optional<Placement> p = map->admit(key);
    if (!p) continue;
    --budget;
    if (p->evicted)
      tables_host[size_t(p->evicted->layer) * E + p->evicted->expert] = arena->host_blob_on_device(*p->evicted);
    if (Status s = arena->load(*p); !s) return s;
    admitted.push_back({key, p->island});
  }
  // Evictions: the next pass must not read those islands.
  return budget < opts.stream_admit_per_pass ? upload_stream_tables() : Status{};
}

Status CudaEngine::Impl::release_experts(int ml) {
  for (int e : bound[size_t(ml)])
    if (Status s = arena->release(*map, ml, e, st); !s) return s;
  bound[size_t(ml)].clear();
  return {};
}

Status CudaEngine::Impl::gemv(const DenseW& W, const bf16* xin, float* y, int n, bool acc, const float* gate,
                              int gate_stride) {
  if (W.q4) return cuda::dense_gemv_q4(W.q4, W.q4m, xin, y, n, acc, gate, gate_stride, st);
  if (W.q) return cuda::dense_gemv_i8(W.q, W.scale, xin, y, n, W.rows, W.cols, acc, gate, gate_stride, st);
  return cuda::dense_gemv_bf16(W.w, xin, y, n, W.rows, W.cols, acc, gate, gate_stride, st);
}

Status CudaEngine::Impl::gemv_rmsnorm(const DenseW& W, const float* xf, const bf16* norm_w, bf16* xn_out, float* y,
                                      int n) {
  if (W.q4)
    return cuda::dense_gemv_q4_rmsnorm(W.q4, W.q4m, xf, norm_w, d.rms_eps, xn_out, y, n, false, nullptr, 0, st);
  if (W.q)
    return cuda::dense_gemv_i8_rmsnorm(W.q, W.scale, xf, norm_w, d.rms_eps, xn_out, y, n, W.rows, W.cols, false,
                                       nullptr, 0, st);
  return cuda::dense_gemv_bf16_rmsnorm(W.w, xf, norm_w, d.rms_eps, xn_out, y, n, W.rows, W.cols, false, nullptr, 0, st);
}

Status CudaEngine::Impl::gemv_silu(const DenseW& W, const float* gu_in, int stride, float* y, int n,
                                   const float* gate) {
  if (W.q4) return cuda::dense_gemv_q4_silu(W.q4, W.q4m, gu_in, stride, y, n, true, gate, stride, st);
  if (W.q)
    return cuda::dense_gemv_i8_silu(W.q, W.scale, gu_in, stride, y, n, W.rows, W.cols, true, gate, stride, st);
  return cuda::dense_gemv_bf16_silu(W.w, gu_in, stride, y, n, W.rows, W.cols, true, gate, stride, st);
}

Status CudaEngine::Impl::project(const DenseW& W, const bf16* xin, float* y, int n, bool acc) {
  if (n <= cuda::kGemvMaxTokens) return gemv(W, xin, y, n, acc, nullptr, 0);
  const bf16* w = W.w;
  if (W.q4) {
    if (Status s = cuda::dequantize_q4(W.q4, W.q4m, dequant, st); !s) return s;
    w = dequant;
  } else if (W.q) {
    if (Status s = cuda::dequantize_rows_i8(W.q, W.scale, W.rows, W.cols, dequant, st); !s) return s;
    w = dequant;
  }
  return mm->matmul(xin, w, y, true, n, W.rows, W.cols, acc ? 1.f : 0.f, st);
}

Status CudaEngine::Impl::mlp(const DevLayer& L, int n, bool fuse) {
  // SiLU(gate) * up, then down (scaled by the shared expert's gate), added to the residual.
  const bool small = n <= cuda::kGemvMaxTokens;
  const int I = L.mlp_inter;
  const float* gate = L.mlp_gated ? gu + 2 * I : nullptr;
  if (fuse) return gemv_silu(L.mlp_down_w, gu, gu_stride, x, n, gate);
  if (Status e = cuda::silu_mul_fused(gu, mh, n, I, st, gu_stride); !e) return e;
  if (small) return gemv(L.mlp_down_w, mh, x, n, true, gate, gu_stride);
  if (gate) {
    if (Status e = project(L.mlp_down_w, mh, tmp, n, false); !e) return e;
    return cuda::gated_add(x, tmp, gate, gu_stride, n, H, st);
  }
  return project(L.mlp_down_w, mh, x, n, true);
}

Status CudaEngine::Impl::moe_layer(const DevLayer& L, int n, bool logits_ready, const int32_t* positions,
                                   const int32_t* seq_of_token, bool fuse) {
  const int ml = L.moe_index;
  // The router's logits: inside the shared projection's output, already
  // made by the fused norm + GEMV, or computed here from xn.
  const float* logits = L.router_row >= 0 ? gu + L.router_row : router_logits;
  const int stride = L.router_row >= 0 ? gu_stride : E;
  if (!logits_ready)
    if (Status s = project(L.router_w, xn, router_logits, n, false); !s) return s;
  int32_t* ids = route_ids + size_t(ml) * n * K;
  const cuda::UniformDraw draw{positions, seq_of_token, ml, opts.uniform_routing_seed};
  // A shared pass posts the layer's share to the host: the router kernel
  // itself for one token, a kernel of its own after it for more.
  cuda::SharePublishArgs a;
  if (sharing) {
    a.tokens = n;
    a.ids = ids;
    a.route_w = route_w;
    a.on_gpu = on_gpu + size_t(ml) * E;
    a.rows = share_rows;
    a.top_k = K;
    a.n_experts = E;
    a.inter = layout.inter;
    a.xn = xn;
    a.hidden = H;
    a.slot = share_slots_dev + ml;
    a.x_host = share_x_dev + size_t(ml) * kShareMaxTokens * H;
    a.pass = share_pass;
    a.gpu_ids = share_ids;
    a.gpu_split = share_split;
    a.host_count = share_count + ml;
  }
  if (Status s = cuda::router_topk(logits, n, E, K, d.moe.norm_topk_prob, d.moe.routed_scaling, ids, route_w, st,
                                   stride, draw, sharing && n == 1 ? &a : nullptr);
      !s)
    return s;
  if (sharing && n > 1)
    if (Status s = cuda::share_publish(a, st); !s) return s;
  auto shared = [&]() -> Status { return L.mlp_gu_w ? mlp(L, n, fuse) : Status{}; };
  if (all_resident || streaming) {
    if (Status s = shared(); !s) return s;
    if (!sharing) return routed_experts(ml, n, ids);
    if (Status s = routed_experts(ml, n, share_ids); !s) return s;
    return cuda::share_collect(share_slots_dev + ml, share_sum_dev + size_t(ml) * kShareMaxTokens * H, x, n, H,
                               share_pass, share_count + ml, kShareTimeoutMs, st);
  }
  // Under a budget the layer's experts are pinned from bind_experts on; they
  // are released whatever happens after, a failure included.
  Status s = bind_experts(ml, n, shared);
  if (s) s = routed_experts(ml, n, ids);
  const Status r = release_experts(ml);
  return s ? r : s;
}

Status CudaEngine::Impl::routed_experts(int ml, int n, const int32_t* ids) {
  const bool small = n <= cuda::kGemvMaxTokens;
  cuda::Q4ExpertArgs a;
  a.layout = layout;
  a.blobs = blob_tables + size_t(ml) * E;
  a.n_experts = E;
  a.expert_ids = host_pairs.empty() ? ids : split_ids;  // the host's pairs as -1: skipped
  if (sharing) a.split = share_split;  // the host's rows of each shared miss
  a.route_weights = route_w;
  a.tokens = n;
  a.top_k = K;
  if (small || !grouped_ok) {
    if (Status s = cuda::q4_expert_gate_up(a, xn, h, st); !s) return s;
    if (Status s = cuda::q4_expert_down(a, h, x, true, st); !s) return s;
  } else if (Status s = cuda::q4_grouped_moe(a, xn, x, grouped_ws, grouped_ws_bytes, st); !s) {
    return s;
  }
  if (!host_pairs.empty()) {
    // The GPU works on the hits and the copied misses meanwhile.
    const auto t0 = std::chrono::steady_clock::now();
    host_x->run(reinterpret_cast<const uint16_t*>(xn_host), n, host_pairs, hsum_host);
    // The split follows what the host really takes (its cores may be busy).
    const double us = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
    host_us_token = 0.9 * host_us_token + 0.1 * us / double(host_pairs.size());
    MOE_CUDA_TRY(cudaMemcpyAsync(hsum, hsum_host, size_t(n) * H * 4, cudaMemcpyHostToDevice, st));
    return cuda::add_inplace(x, hsum, int64_t(n) * H, st);
  }
  return {};
}

Status CudaEngine::Impl::forward(const PassPack& pk, int n, int s) {
  // Up to this many tokens RMSNorm and SiLU are folded into the GEMVs'
  // staging (fewer launches); above, every block re-reading the f32 inputs
  // costs more than the launches saved (docs/cuda.md).
  const bool fuse = n <= opts.fuse_max_tokens;
  const auto* tokens = reinterpret_cast<const int32_t*>(pack_dev + pk.tokens);
  const auto* positions = reinterpret_cast<const int32_t*>(pack_dev + pk.positions);
  const auto* seq_of_token = reinterpret_cast<const int32_t*>(pack_dev + pk.seq_of_token);
  const auto* tables = reinterpret_cast<const int32_t*>(pack_dev + pk.tables);
  const float eps = d.rms_eps;
  if (Status e = cuda::embedding_gather(embed, V, H, tokens, n, x, st); !e) return e;
  for (const DevLayer& L : layers) {
    advanced();
    cuda::PagedKvPool kv{L.k_pool, L.v_pool, tables, max_blocks, kBlockTokens, d.n_kv_heads, d.head_dim};
    if (fuse) {
      if (Status e = gemv_rmsnorm(L.qkv_w, x, L.in_norm, nullptr, qkv, n); !e) return e;
    } else {
      if (Status e = cuda::rmsnorm(x, L.in_norm, xn, n, H, eps, st); !e) return e;
      if (Status e = project(L.qkv_w, xn, qkv, n, false); !e) return e;
    }
    cuda::QkvRopeArgs ra;
    ra.qkv = qkv;
    ra.bias = L.qkv_b;
    ra.q_norm = L.q_norm;
    ra.k_norm = L.k_norm;
    ra.qk_norm_full_width = d.qk_norm == QkNorm::whole;
    ra.eps = eps;
    ra.positions = positions;
    ra.seq_of_token = seq_of_token;
    ra.inv_freq = inv_freq;
    ra.attention_factor = attention_factor;
    ra.tokens = n;
    ra.n_heads = d.n_heads;
    ra.q_out = q;
    if (Status e = cuda::qkv_rope_store(ra, kv, st); !e) return e;
    cuda::AttentionArgs aa;
    aa.q = q;
    aa.seq_of_token = seq_of_token;
    aa.positions = positions;
    aa.tokens = n;
    aa.n_heads = d.n_heads;
    aa.scale = 1.f / std::sqrt(float(d.head_dim));
    aa.out = attn;
    if (Status e = cuda::paged_attention(aa, kv, st); !e) return e;
    if (Status e = project(L.o_w, attn, x, n, true); !e) return e;
    // The normed state xn and the first projection after attention: the
    // shared expert's / dense MLP's gate|up (with the router's rows when the
    // layer has both), or the router alone. Small batches norm inside the GEMV.
    bool logits_ready = false;
    if (fuse && (L.mlp_gu_w || L.moe_index >= 0)) {
      const DenseW& w = L.mlp_gu_w ? L.mlp_gu_w : L.router_w;
      if (Status e = gemv_rmsnorm(w, x, L.post_norm, xn, L.mlp_gu_w ? gu : router_logits, n); !e) return e;
      logits_ready = true;
    } else {
      if (Status e = cuda::rmsnorm(x, L.post_norm, xn, n, H, eps, st); !e) return e;
      if (L.mlp_gu_w) {
        if (Status e = project(L.mlp_gu_w, xn, gu, n, false); !e) return e;
        logits_ready = L.router_row >= 0;
      }
    }
    if (L.moe_index >= 0) {
      // The shared expert runs between the router and the routed experts:
      // under a budget it overlaps the host's wait for the routes and the
      // misses' copies.
      if (Status e = moe_layer(L, n, logits_ready, positions, seq_of_token, fuse); !e) return e;
    } else if (L.mlp_gu_w) {
      if (Status e = mlp(L, n, fuse); !e) return e;
    }
  }
  if (s == 0) return {};
  const auto* rows = reinterpret_cast<const int32_t*>(pack_dev + pk.sample_rows);
  if (Status e = cuda::gather_rows_f32(x, rows, s, H, xs, st); !e) return e;
  if (Status e = cuda::rmsnorm(xs, final_norm, xsn, s, H, eps, st); !e) return e;
  if (lm_head.quantised()) {
    // The quantised vocabulary projection is too large to turn back into bf16:
    // GEMVs of up to 8 rows.
    for (int r0 = 0; r0 < s; r0 += cuda::kGemvMaxTokens)
      if (Status e = gemv(lm_head, xsn + size_t(r0) * H, logits + size_t(r0) * V,
                          std::min(cuda::kGemvMaxTokens, s - r0), false, nullptr, 0);
          !e)
        return e;
  } else if (Status e = project(lm_head, xsn, logits, s, false); !e) {
    return e;
  }
  return cuda::sample_tokens(logits, s, V, reinterpret_cast<const cuda::SampleRowParams*>(pack_dev + pk.params),
                             reinterpret_cast<const int64_t*>(pack_dev + pk.sample_pos), sampled, st);
}

// ---------------------------------------------------------------- steps

Result<std::vector<SeqOutput>> CudaEngine::step(std::span<const SeqInput> inputs) {
  Impl& m = *impl_;
  const ModelDesc& d = m.d;
  auto blocks_for = [](int tokens) { return (tokens + kBlockTokens - 1) / kBlockTokens; };
  // Check everything first: a refused step changes nothing.
  const Status checked = check_step_inputs(inputs, d.vocab_size, m.max_context, kBlockTokens, int(m.free_blocks.size()),
                                           [&m](uint64_t id) -> std::optional<HeldSequence> {
                                             auto it = m.seqs.find(id);
                                             if (it == m.seqs.end()) return std::nullopt;
                                             return HeldSequence{it->second.length, int(it->second.blocks.size())};
                                           });
  if (!checked.ok()) return make_error(checked.error());
  for (const SeqInput& in : inputs) {
    if (in.start_pos == 0) release(in.seq_id);
    Impl::Sequence& s = m.seqs[in.seq_id];
    const int end = in.start_pos + int(in.tokens.size());
    while (int(s.blocks.size()) < blocks_for(end)) {
      s.blocks.push_back(m.free_blocks.back());
      m.free_blocks.pop_back();
    }
    s.length = end;
  }

  const size_t per_seq = size_t(m.Lm) * m.E;
  std::vector<SeqOutput> out(inputs.size());
  for (size_t i = 0; i < inputs.size(); ++i) {
    out[i].seq_id = inputs[i].seq_id;
    out[i].expert_counts.assign(per_seq, 0);
  }

  // Pieces: runs of one sequence's tokens, packed into passes of at most T
  // tokens and kMaxSampleRows sampled rows.
  struct Piece {
    size_t input;
    int begin, count;
    bool sample;
  };
  std::vector<std::vector<Piece>> passes(1);
  int pass_tokens = 0, pass_samples = 0;
  for (size_t i = 0; i < inputs.size(); ++i) {
    const SeqInput& in = inputs[i];
    int done = 0;
    const int total = int(in.tokens.size());
    while (done < total) {
      if (pass_tokens == m.T) {
        passes.emplace_back();
        pass_tokens = pass_samples = 0;
      }
      const int c = std::min(total - done, m.T - pass_tokens);
      const bool last = done + c == total;
      const bool sample = last && in.sample;
      if (sample && pass_samples == kMaxSampleRows) {
        passes.emplace_back();
        pass_tokens = pass_samples = 0;
        continue;
      }
      passes.back().push_back({i, done, c, sample});
      pass_tokens += c;
      pass_samples += sample ? 1 : 0;
      done += c;
    }
  }

  for (const std::vector<Piece>& pass : passes) {
    if (pass.empty()) continue;
    int n = 0, s = 0;
    for (const Piece& p : pass) {
      n += p.count;
      s += p.sample ? 1 : 0;
    }
    const int pieces = int(pass.size());
    const Impl::PassPack pk = m.pack_layout(n, s, pieces);
    auto* tok = reinterpret_cast<int32_t*>(m.pack_host + pk.tokens);
    auto* pos = reinterpret_cast<int32_t*>(m.pack_host + pk.positions);
    auto* sot = reinterpret_cast<int32_t*>(m.pack_host + pk.seq_of_token);
    auto* rows = reinterpret_cast<int32_t*>(m.pack_host + pk.sample_rows);
    auto* spos = reinterpret_cast<int64_t*>(m.pack_host + pk.sample_pos);
    auto* prm = reinterpret_cast<cuda::SampleRowParams*>(m.pack_host + pk.params);
    auto* tab = reinterpret_cast<int32_t*>(m.pack_host + pk.tables);
    std::vector<size_t> sample_input;  // [s]: the input each sampled row answers
    int t = 0;
    bool pure_decode = n <= cuda::kGemvMaxTokens;
    for (int pi = 0; pi < pieces; ++pi) {
      const Piece& p = pass[size_t(pi)];
      const SeqInput& in = inputs[p.input];
      const Impl::Sequence& sq = m.seqs[in.seq_id];
      std::fill(tab + size_t(pi) * m.max_blocks, tab + size_t(pi + 1) * m.max_blocks, 0);
      std::copy(sq.blocks.begin(), sq.blocks.end(), tab + size_t(pi) * m.max_blocks);
      for (int j = 0; j < p.count; ++j, ++t) {
        tok[t] = in.tokens[size_t(p.begin + j)];
        pos[t] = in.start_pos + p.begin + j;
        sot[t] = pi;
      }
      pure_decode = pure_decode && p.count == 1 && p.sample;
      if (p.sample) {
        const int r = int(sample_input.size());
        rows[r] = t - 1;
        spos[r] = int64_t(in.start_pos) + int64_t(in.tokens.size());
        prm[r] = {in.sampling.temperature, in.sampling.top_p, in.sampling.top_k, in.sampling.seed};
        sample_input.push_back(p.input);
      }
    }
    MOE_CUDA_TRY(cudaMemcpyAsync(m.pack_dev, m.pack_host, pk.bytes, cudaMemcpyHostToDevice, m.st));

    // Resident decode steps replay a graph captured for their batch size
    // (from the second step of that size: the first runs eagerly and sets up
    // the kernels' attributes).
    m.streaming = m.stream_pass(n);
    if (m.streaming)
      if (Status ps = m.prepare_streamed_pass(); !ps) return make_error(ps.error());
    // The host's share: its threads serve this pass's layers as the GPU
    // posts them; on every way out of the pass they are done with it (or
    // abandon it when the pass failed).
    m.sharing = m.streaming && m.share && n <= kShareMaxTokens && m.share_misses[size_t(n)] >= Impl::kShareMinMisses;
    struct ShareScope {  // left with s set only when the pass failed
      HostShare* s = nullptr;
      ~ShareScope() {
        if (s) s->end(false);
      }
    } share_scope;
    if (m.sharing) {
      if (++m.share_pass_no == 0) ++m.share_pass_no;  // 0 is what fresh slots hold
      *m.pass_host = m.share_pass_no;
      MOE_CUDA_TRY(cudaMemcpyAsync(m.share_pass, m.pass_host, sizeof(uint32_t), cudaMemcpyHostToDevice, m.st));
      m.share->begin(m.share_pass_no);
      share_scope.s = m.share.get();
    }
    Impl::Graph* g = nullptr;
    if (pure_decode && (m.all_resident || m.streaming) && m.opts.graphs) {
      g = &m.graphs[2 * n + (m.sharing ? 1 : 0)];
      if (!g->exec && g->seen++ >= 1) {
        cudaGraph_t graph = nullptr;
        MOE_CUDA_TRY(cudaStreamBeginCapture(m.st, cudaStreamCaptureModeThreadLocal));
        const Status fs = m.forward(pk, n, s);
        const cudaError_t ce = cudaStreamEndCapture(m.st, &graph);
        if (!fs) return make_error(fs.error());
        MOE_CUDA_TRY(ce);
        const cudaError_t ie = cudaGraphInstantiate(&g->exec, graph, 0);
        cudaGraphDestroy(graph);
        MOE_CUDA_TRY(ie);
      }
    }
    if (g && g->exec) {
      MOE_CUDA_TRY(cudaGraphLaunch(g->exec, m.st));
    } else if (Status fs = m.forward(pk, n, s); !fs) {
      return make_error(fs.error());
    }

    if (s > 0) MOE_CUDA_TRY(cudaMemcpyAsync(m.sampled_host, m.sampled, size_t(s) * 4, cudaMemcpyDeviceToHost, m.st));
    for (int r = 0; r < s; ++r) {
      const SamplingParams& sp = inputs[sample_input[size_t(r)]].sampling;
      if (sp.logprobs || sp.top_logprobs > 0 || inputs[sample_input[size_t(r)]].score_token >= 0)
        MOE_CUDA_TRY(cudaMemcpyAsync(m.logits_host + size_t(r) * m.V, m.logits + size_t(r) * m.V, size_t(m.V) * 4,
                                     cudaMemcpyDeviceToHost, m.st));
    }
    if (m.Lm > 0 && (m.all_resident || m.streaming))
      MOE_CUDA_TRY(cudaMemcpyAsync(m.ids_host, m.route_ids, size_t(m.Lm) * n * m.K * 4, cudaMemcpyDeviceToHost, m.st));
    MOE_CUDA_TRY(cudaStreamSynchronize(m.st));
    m.advanced();
    if (share_scope.s) {
      share_scope.s->end(true);
      share_scope.s = nullptr;
    }
    if (m.streaming)
      if (Status as = m.after_streamed_pass(n); !as) return make_error(as.error());

    // Expert use per sequence (the ids of each MoE layer, token by token).
    t = 0;
    for (const Piece& p : pass) {
      uint16_t* counts = out[p.input].expert_counts.data();
      for (int j = 0; j < p.count; ++j, ++t)
        for (int ml = 0; ml < m.Lm; ++ml) {
          const int32_t* r = m.ids_host + (size_t(ml) * n + size_t(t)) * m.K;
          for (int k = 0; k < m.K; ++k)
            if (r[k] >= 0 && r[k] < m.E) {
              uint16_t& c = counts[size_t(ml) * m.E + size_t(r[k])];
              if (c < UINT16_MAX) ++c;
            }
        }
    }
    for (int r = 0; r < s; ++r) {
      const size_t i = sample_input[size_t(r)];
      SeqOutput& o = out[i];
      o.token = m.sampled_host[r];
      const SamplingParams& sp = inputs[i].sampling;
      const float* row = m.logits_host + size_t(r) * m.V;
      if (sp.logprobs || sp.top_logprobs > 0) o.logprob = cpu::token_logprob(row, m.V, o.token);
      if (sp.top_logprobs > 0) o.top = cpu::top_logprobs(row, m.V, sp.top_logprobs);
      if (const int32_t st = inputs[i].score_token; st >= 0 && st < m.V) o.score_logprob = cpu::token_logprob(row, m.V, st);
    }
  }
  // Now and then: nothing may have been allocated on the device since the
  // start (the budget is the whole process's).
  if (m.meter && ++m.steps_since_check >= 256) {
    m.steps_since_check = 0;
    const DeviceMemory dm = device_memory();
    if (dm.measured && dm.now > m.budget_bytes && !m.over_budget_said) {
      m.over_budget_said = true;
      std::fprintf(stderr, "moe-worker: the process holds %s on the device, over its budget of %s\n",
                   format_bytes(dm.now).c_str(), format_bytes(m.budget_bytes).c_str());
    }
  }
  return out;
}

void CudaEngine::set_progress(std::atomic<uint64_t>* progress) { impl_->progress = progress; }

DeviceMemory CudaEngine::device_memory() const {
  Impl& m = *impl_;
  DeviceMemory d;
  d.budget = m.budget_bytes;
  d.base = m.base_device_bytes;
  d.arena = m.plan.arena_bytes;
  if (m.meter) {
    if (auto b = m.meter->process_bytes()) {
      d.now = *b;
      d.measured = true;
      m.peak_device_bytes = std::max(m.peak_device_bytes, *b);
    }
  }
  d.peak = m.peak_device_bytes;
  return d;
}

void CudaEngine::release(uint64_t seq_id) {
  Impl& m = *impl_;
  auto it = m.seqs.find(seq_id);
  if (it == m.seqs.end()) return;
  for (int32_t b : it->second.blocks) m.free_blocks.push_back(b);
  m.seqs.erase(it);
}

int CudaEngine::kv_blocks_total() const { return impl_->kv_blocks; }
int CudaEngine::kv_blocks_free() const { return int(impl_->free_blocks.size()); }
int CudaEngine::kv_block_tokens() const { return kBlockTokens; }
int CudaEngine::max_context() const { return impl_->max_context; }
int CudaEngine::seq_length(uint64_t seq_id) const {
  auto it = impl_->seqs.find(seq_id);
  return it == impl_->seqs.end() ? -1 : it->second.length;
}
const ModelDesc& CudaEngine::desc() const { return impl_->d; }
const IslandPlan& CudaEngine::plan() const { return impl_->plan; }

// ---------------------------------------------------------------- experts

size_t CudaEngine::warm(std::span<const ExpertKey> experts, bool may_evict) {
  Impl& m = *impl_;
  if (!m.map) return 0;
  size_t resident = 0;
  for (const ExpertKey& k : experts) {
    if (k.layer < 0 || k.layer >= m.Lm || k.expert < 0 || k.expert >= m.E) continue;
    const int e = k.expert;
    if (m.map->lookup(k) < 0) {
      const HintPriority pr = may_evict ? HintPriority::prefetch : HintPriority::warm;
      if (Status s = m.arena->prefetch(*m.map, k.layer, std::span<const int>(&e, 1), pr); !s) {
        std::fprintf(stderr, "moe-worker: warming expert %d/%d failed: %s\n", k.layer, k.expert, s.error().c_str());
        continue;
      }
      if (m.map->lookup(k) >= 0) {
        ++m.residency_version;
        m.stream_tables_stale = true;
      }
    }
    if (m.map->lookup(k) >= 0) ++resident;
  }
  return resident;
}

std::vector<ExpertKey> CudaEngine::unload(std::span<const ExpertKey> experts) {
  Impl& m = *impl_;
  // With every expert resident the pointer tables are fixed (and dropping
  // one would gain nothing): unloads are refused.
  if (!m.map || m.all_resident) return std::vector<ExpertKey>(experts.begin(), experts.end());
  std::vector<ExpertKey> failed;
  for (const ExpertKey& k : experts) {
    const bool was = k.layer >= 0 && k.layer < m.Lm && k.expert >= 0 && k.expert < m.E && m.map->lookup(k) >= 0;
    if (Status s = m.map->drop(k); !s) {
      failed.push_back(k);
      continue;
    }
    if (was) {
      ++m.residency_version;
      m.stream_tables_stale = true;
    }
  }
  return failed;
}

std::vector<ExpertKey> CudaEngine::resident() const {
  std::vector<ExpertKey> out;
  const Impl& m = *impl_;
  if (!m.map) return out;
  for (int64_t i = 0; i < m.map->n_islands(); ++i)
    if (auto k = m.map->resident(i)) out.push_back(*k);
  std::sort(out.begin(), out.end(),
            [](const ExpertKey& a, const ExpertKey& b) { return a.layer != b.layer ? a.layer < b.layer : a.expert < b.expert; });
  return out;
}

uint64_t CudaEngine::residency_version() const {
  const Impl& m = *impl_;
  // Every copy into an island changes the resident set too.
  return m.residency_version + (m.map ? m.map->stats().copies() : 0);
}

std::string CudaEngine::device_error() const {
  // A sticky error poisons the context: every later call returns it.
  const cudaError_t e = cudaStreamSynchronize(impl_->st);
  if (e == cudaSuccess) return {};
  return std::string(cudaGetErrorName(e)) + ": " + cudaGetErrorString(e);
}

CudaExpertStats CudaEngine::expert_stats() const {
  CudaExpertStats s;
  const Impl& m = *impl_;
  if (m.map) s.residency = m.map->stats();
  s.islands_total = m.plan.n_islands;
  s.all_resident = m.all_resident;
  s.dense_weights = dense_name(m.dense);
  s.host_embedding = m.embed_host;
  s.host_experts_served = m.host_experts_served;
  s.host_expert_tokens = m.host_expert_tokens;
  s.host_share_served = m.share ? m.share->experts_served() : 0;
  if (m.share) s.share_times = m.share->times();
  s.bytes_streamed = m.bytes_streamed;
  return s;
}

}  // namespace moe
