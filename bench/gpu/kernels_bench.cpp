// moe-bench-kernels: the CUDA kernels alone, not a model (the model's
// figures come from moe-bench-engine). Each kernel is called through its
// launcher in kernels/cuda with seeded random inputs at the sizes of the two
// shapes of bench/gpu/model_shapes.h and timed with CUDA events. Sections:
//   kernels  INT4 expert gate/up + SiLU and weighted down (1 and 8 tokens),
//            the grouped INT4 MoE GEMM (a prompt), bf16 GEMVs (q|k|v,
//            lm_head) and cuBLASLt (q|k|v), RMSNorm, router top-k, the
//            uniform expert draw, RoPE + KV store and paged attention, at 1
//            and 8 tokens (decode) and a prompt. One graph holds one call per
//            layer, every layer with weights of its own, so that weights come
//            from DRAM and not from L2; 10 replays a run, the median of 5 runs.
//   dense    the dense decode GEMVs in each weight dtype (bf16, INT8, INT4)
//            at the shape's q|k|v, o, router and lm_head, 1 and 8 tokens,
//            plain and RMSNorm-fused input: 200 launches of one matrix in a
//            graph, the best of 5 replays (a matrix smaller than L2 stays in it).
//   copy     the host-to-device link alone: ~1.6 GB as back-to-back copies of
//            the shape's INT4 expert blob on one stream, from host memory
//            registered in place (as expert files are) and from
//            cudaMallocHost; the median of 3 runs each.
// Bytes are the weights (or KV, or copies) a call reads once; GB/s and
// TFLOP/s divide them by the time.
//   moe-bench-kernels [--shape qwen15|qwen3|all] [--only kernels,dense,copy]
//                     [--layers N] [--context N] [--prompt N] [--json PATH] [--commit HASH]
// --layers: layers of weights in the kernels section (default: the shape's;
// fewer fit a smaller GPU). Without a CUDA device it prints
// "SKIPPED: no CUDA device" and exits 0.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <fstream>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "bench/gpu/model_shapes.h"
#include "kernels/cuda/attention.cuh"
#include "kernels/cuda/cuda_check.cuh"
#include "kernels/cuda/dense_matmul.cuh"
#include "kernels/cuda/norm.cuh"
#include "kernels/cuda/q4_gemm.cuh"
#include "kernels/cuda/q4_gemv.cuh"
#include "kernels/cuda/rope.cuh"
#include "kernels/cuda/router.cuh"
#include "model/int4.h"

namespace {

using moe::make_error;
using moe::Result;
using moe::Status;
using moe::bench::ModelShape;
using bf16 = __nv_bfloat16;

constexpr int kGroup = 64;        // the experts' INT4 group, as the worker quantises them
constexpr int kBlockTokens = 16;  // KV block size
constexpr float kEps = 1e-6f;

struct Options {
  std::string shape = "all";
  bool kernels = true, dense = true, copy = true;
  int layers = 0;  // 0: the shape's
  int context = 128, prompt = 512;
  std::string json;
  std::string commit = MOE_BENCH_COMMIT;  // the configure-time commit unless --commit
};

struct Row {
  std::string section, shape, kernel;
  double us = 0, bytes = 0, flops = 0;
};

// ---- random inputs, made on the host from a seed ----

uint64_t next_u64(uint64_t& s) {
  uint64_t z = (s += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

float next_unit(uint64_t& s) { return float(next_u64(s) >> 40) * (1.f / 16777216.f); }  // [0, 1)

// Device memory freed at scope exit.
class DeviceMemory {
 public:
  DeviceMemory() = default;
  DeviceMemory(const DeviceMemory&) = delete;
  DeviceMemory& operator=(const DeviceMemory&) = delete;
  ~DeviceMemory() {
    for (void* p : blocks_) cudaFree(p);
  }
  template <typename T>
  Status alloc(T** p, size_t count) {
    void* v = nullptr;
    MOE_CUDA_TRY(cudaMalloc(&v, std::max<size_t>(count, 1) * sizeof(T)));
    blocks_.push_back(v);
    *p = static_cast<T*>(v);
    return {};
  }

 private:
  std::vector<void*> blocks_;
};

// d[i] = offset + U(-scale, scale), made in chunks so that a large table
// needs no host copy of its own.
template <typename T>
Status fill_uniform(T* d, size_t n, float scale, float offset, uint64_t seed) {
  constexpr size_t kChunk = size_t(1) << 22;
  std::vector<T> h(std::min(n, kChunk));
  for (size_t at = 0; at < n; at += kChunk) {
    const size_t m = std::min(kChunk, n - at);
    for (size_t i = 0; i < m; ++i) h[i] = T(offset + scale * (2.f * next_unit(seed) - 1.f));
    MOE_CUDA_TRY(cudaMemcpy(d + at, h.data(), m * sizeof(T), cudaMemcpyHostToDevice));
  }
  return {};
}

template <typename T>
Status upload(DeviceMemory& mem, T** d, const std::vector<T>& h) {
  MOE_TRY(mem.alloc(d, h.size()));
  MOE_CUDA_TRY(cudaMemcpy(*d, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice));
  return {};
}

// n_experts blobs in `L`'s layout at `d` (stride L.blob_bytes): random codes,
// and per group a scale ~ U(0.5, 1.5) / (4.6 sqrt(fan_in)) with bias -7.5 *
// scale, so that the weights are centred on zero and activations stay O(1).
Status fill_expert_layer(uint8_t* d, const moe::ExpertLayout& L, int n_experts, uint64_t seed) {
  std::vector<uint8_t> h(L.blob_bytes * size_t(n_experts));
  for (size_t i = 0; i + 8 <= h.size(); i += 8) {
    const uint64_t v = next_u64(seed);
    std::memcpy(h.data() + i, &v, 8);
  }
  const moe::Q4MatrixLayout* ms[3] = {&L.gate, &L.up, &L.down};
  for (int e = 0; e < n_experts; ++e)
    for (const moe::Q4MatrixLayout* m : ms) {
      const float base = float(1.0 / (4.6 * std::sqrt(double(m->cols))));
      const size_t count = size_t(m->rows) * size_t(m->cols / m->group);
      uint8_t* params = h.data() + size_t(e) * L.blob_bytes + m->params_offset;
      for (size_t i = 0; i < count; ++i) {
        const float s = base * (0.5f + next_unit(seed));
        const half2 p = __floats2half2_rn(s, -7.5f * s);
        std::memcpy(params + 4 * i, &p, 4);
      }
    }
  MOE_CUDA_TRY(cudaMemcpy(d, h.data(), h.size(), cudaMemcpyHostToDevice));
  return {};
}

// ---- timing ----

struct Timer {
  cudaStream_t st = nullptr;
  cudaEvent_t a = nullptr, b = nullptr;
  ~Timer() {
    if (a) cudaEventDestroy(a);
    if (b) cudaEventDestroy(b);
    if (st) cudaStreamDestroy(st);
  }
};

// Runs `body` once eagerly (kernel attributes and cuBLASLt's algorithm are
// set outside the capture), captures it into a graph, and returns the
// microseconds of one replay: `replays` back-to-back replays a run, `runs`
// runs, the median run (best: the fastest).
Result<double> time_graph(const std::function<Status()>& body, int replays, int runs, bool best, Timer& t) {
  MOE_TRY(body());
  MOE_CUDA_TRY(cudaStreamSynchronize(t.st));
  cudaGraph_t g = nullptr;
  MOE_CUDA_TRY(cudaStreamBeginCapture(t.st, cudaStreamCaptureModeRelaxed));
  const Status captured = body();
  const cudaError_t ended = cudaStreamEndCapture(t.st, &g);
  if (!captured.ok()) {
    if (g) cudaGraphDestroy(g);
    return make_error(captured.error());
  }
  MOE_CUDA_TRY(ended);
  cudaGraphExec_t ge = nullptr;
  const cudaError_t made = cudaGraphInstantiate(&ge, g, 0);
  cudaGraphDestroy(g);
  MOE_CUDA_TRY(made);
  struct ExecFree {
    cudaGraphExec_t e;
    ~ExecFree() { cudaGraphExecDestroy(e); }
  } exec_free{ge};
  MOE_CUDA_TRY(cudaGraphLaunch(ge, t.st));  // warm: clocks, instruction cache
  std::vector<double> us;
  for (int r = 0; r < runs; ++r) {
    MOE_CUDA_TRY(cudaEventRecord(t.a, t.st));
    for (int i = 0; i < replays; ++i) MOE_CUDA_TRY(cudaGraphLaunch(ge, t.st));
    MOE_CUDA_TRY(cudaEventRecord(t.b, t.st));
    MOE_CUDA_TRY(cudaEventSynchronize(t.b));
    float ms = 0;
    MOE_CUDA_TRY(cudaEventElapsedTime(&ms, t.a, t.b));
    us.push_back(double(ms) * 1000.0 / replays);
  }
  std::sort(us.begin(), us.end());
  return best ? us.front() : us[us.size() / 2];
}

void print_header(const char* what, const ModelShape& s) {
  std::printf("\n== %s: %s\n   %-52s %10s %10s %10s\n", s.name.c_str(), what, "kernel", "us/call", "GB/s",
              "TFLOP/s");
  std::fflush(stdout);
}

void print_row(const Row& r) {
  const double s = r.us * 1e-6;
  std::printf("   %-52s %10.2f %10.0f %10.1f\n", r.kernel.c_str(), r.us, r.bytes / s / 1e9, r.flops / s / 1e12);
  std::fflush(stdout);
}

std::string str(int v) { return std::to_string(v); }

// ---- kernels: each family at the shape's decode and prompt sizes ----

Status bench_kernels(const ModelShape& s, const Options& o, Timer& t, std::vector<Row>& rows) {
  const int H = s.hidden, E = s.n_experts, K = s.top_k, I = s.inter, hd = s.head_dim;
  const int W = (s.n_heads + 2 * s.n_kv) * hd, QD = s.n_heads * hd;
  const int nl = o.layers > 0 ? std::min(o.layers, s.layers) : s.layers;
  const int P = o.prompt, D = moe::cuda::kGemvMaxTokens, C = o.context;
  const int T = std::max(P, D);
  const moe::ExpertLayout lay = moe::expert_layout(H, I, kGroup);
  const size_t layer_bytes = lay.blob_bytes * size_t(E);
  const int max_blocks = (std::max(C + 1, P) + kBlockTokens - 1) / kBlockTokens;
  const size_t kv_elems = size_t(D) * max_blocks * kBlockTokens * s.n_kv * hd;  // D sequences
  MOE_CUDA_REQUIRE(moe::cuda::q4_grouped_supported(lay), "the grouped GEMM does not take this shape");
  {
    // Refuse early, with what would fit, rather than fail half-way.
    const double need = double(nl) * (double(layer_bytes) + double(W) * H * 2 + 4.0 * kv_elems) +
                        double(s.vocab) * H * 2 + 256.0 * (1 << 20);  // activations, workspaces
    size_t free_b = 0, total_b = 0;
    MOE_CUDA_TRY(cudaMemGetInfo(&free_b, &total_b));
    if (need > 0.95 * double(free_b))
      return make_error("the kernels section needs " + std::to_string(int(need / (1 << 20))) + " MiB for " +
                        str(nl) + " layers, " + std::to_string(int(free_b >> 20)) +
                        " MiB are free: pass fewer --layers");
  }
  std::printf("\n   making %d layers of random weights (%.1f GiB)...\n", nl,
              double(nl) * double(layer_bytes + size_t(W) * H * 2) / double(1ull << 30));
  std::fflush(stdout);
  DeviceMemory mem;
  uint64_t seed = 1234;
  // Experts: one layer made on the host, copied to the others (distinct
  // addresses are what keeps them out of L2).
  uint8_t* experts = nullptr;
  MOE_TRY(mem.alloc(&experts, layer_bytes * size_t(nl)));
  MOE_TRY(fill_expert_layer(experts, lay, E, ++seed));
  for (int l = 1; l < nl; ++l)
    MOE_CUDA_TRY(cudaMemcpy(experts + size_t(l) * layer_bytes, experts, layer_bytes, cudaMemcpyDeviceToDevice));
  std::vector<const uint8_t*> ptrs(size_t(nl) * E);
  for (size_t i = 0; i < ptrs.size(); ++i) ptrs[i] = experts + i * lay.blob_bytes;
  const uint8_t** tables = nullptr;
  MOE_TRY(upload(mem, &tables, ptrs));
  // bf16 weights: q|k|v per layer, lm_head once (622 MB: far beyond L2).
  bf16 *qkv_w = nullptr, *lm_head = nullptr, *norm_w = nullptr, *bias = nullptr, *q_norm = nullptr,
       *k_norm = nullptr;
  MOE_TRY(mem.alloc(&qkv_w, size_t(nl) * W * H));
  MOE_TRY(fill_uniform(qkv_w, size_t(W) * H, float(std::sqrt(3.0 / H)), 0.f, ++seed));
  for (int l = 1; l < nl; ++l)
    MOE_CUDA_TRY(cudaMemcpy(qkv_w + size_t(l) * W * H, qkv_w, size_t(W) * H * 2, cudaMemcpyDeviceToDevice));
  MOE_TRY(mem.alloc(&lm_head, size_t(s.vocab) * H));
  MOE_TRY(fill_uniform(lm_head, size_t(s.vocab) * H, float(std::sqrt(3.0 / H)), 0.f, ++seed));
  MOE_TRY(mem.alloc(&norm_w, size_t(H)));
  MOE_TRY(fill_uniform(norm_w, size_t(H), 0.1f, 1.f, ++seed));
  if (s.qkv_bias) {
    MOE_TRY(mem.alloc(&bias, size_t(W)));
    MOE_TRY(fill_uniform(bias, size_t(W), 0.1f, 0.f, ++seed));
  }
  if (s.qk_norm) {
    MOE_TRY(mem.alloc(&q_norm, size_t(hd)));
    MOE_TRY(mem.alloc(&k_norm, size_t(hd)));
    MOE_TRY(fill_uniform(q_norm, size_t(hd), 0.1f, 1.f, ++seed));
    MOE_TRY(fill_uniform(k_norm, size_t(hd), 0.1f, 1.f, ++seed));
  }
  // KV pools, one per layer: D sequences of max_blocks blocks each.
  bf16* kv = nullptr;
  MOE_TRY(mem.alloc(&kv, 2 * kv_elems * size_t(nl)));
  MOE_TRY(fill_uniform(kv, 2 * kv_elems, 1.f, 0.f, ++seed));
  for (int l = 1; l < nl; ++l)
    MOE_CUDA_TRY(cudaMemcpy(kv + 2 * kv_elems * size_t(l), kv, 2 * kv_elems * 2, cudaMemcpyDeviceToDevice));
  std::vector<int32_t> table(size_t(D) * max_blocks);
  for (size_t i = 0; i < table.size(); ++i) table[i] = int32_t(i);
  int32_t* block_tables = nullptr;
  MOE_TRY(upload(mem, &block_tables, table));
  auto pool = [&](int l) {
    bf16* k = kv + 2 * kv_elems * size_t(l);
    return moe::cuda::PagedKvPool{k, k + kv_elems, block_tables, max_blocks, kBlockTokens, s.n_kv, hd};
  };
  std::vector<float> inv(size_t(hd / 2));
  for (int i = 0; i < hd / 2; ++i) inv[size_t(i)] = float(1.0 / std::pow(double(s.rope_theta), 2.0 * i / hd));
  float* inv_freq = nullptr;
  MOE_TRY(upload(mem, &inv_freq, inv));
  // Positions: decode, D sequences each at position C; a prompt, sequence 0 at 0..P-1.
  std::vector<int32_t> dec_pos(static_cast<size_t>(D), C), dec_seq(static_cast<size_t>(D)),
      pre_pos(static_cast<size_t>(P)), pre_seq(static_cast<size_t>(P), 0);
  for (int i = 0; i < D; ++i) dec_seq[size_t(i)] = i;
  for (int i = 0; i < P; ++i) pre_pos[size_t(i)] = i;
  int32_t *d_dec_pos = nullptr, *d_dec_seq = nullptr, *d_pre_pos = nullptr, *d_pre_seq = nullptr;
  MOE_TRY(upload(mem, &d_dec_pos, dec_pos));
  MOE_TRY(upload(mem, &d_dec_seq, dec_seq));
  MOE_TRY(upload(mem, &d_pre_pos, pre_pos));
  MOE_TRY(upload(mem, &d_pre_seq, pre_seq));
  // Activations, sized for the prompt.
  bf16 *xn = nullptr, *q = nullptr, *attn = nullptr;
  float *x = nullptr, *h = nullptr, *qkv = nullptr, *logits = nullptr, *router_logits = nullptr,
        *route_w = nullptr, *scratch_w = nullptr;
  int32_t *ids = nullptr, *scratch_ids = nullptr;
  MOE_TRY(mem.alloc(&xn, size_t(T) * H));
  MOE_TRY(mem.alloc(&q, size_t(T) * QD));
  MOE_TRY(mem.alloc(&attn, size_t(T) * QD));
  MOE_TRY(mem.alloc(&x, size_t(T) * H));
  MOE_TRY(mem.alloc(&h, size_t(D) * K * I));
  MOE_TRY(mem.alloc(&qkv, size_t(T) * W));
  MOE_TRY(mem.alloc(&logits, size_t(D) * s.vocab));
  MOE_TRY(mem.alloc(&router_logits, size_t(T) * E));
  MOE_TRY(mem.alloc(&route_w, size_t(T) * K));
  MOE_TRY(mem.alloc(&scratch_w, size_t(T) * K));
  MOE_TRY(mem.alloc(&ids, size_t(T) * K));
  MOE_TRY(mem.alloc(&scratch_ids, size_t(T) * K));
  MOE_TRY(fill_uniform(xn, size_t(T) * H, 1.f, 0.f, ++seed));
  MOE_TRY(fill_uniform(q, size_t(T) * QD, 1.f, 0.f, ++seed));
  MOE_TRY(fill_uniform(x, size_t(T) * H, 1.f, 0.f, ++seed));
  MOE_TRY(fill_uniform(h, size_t(D) * K * I, 1.f, 0.f, ++seed));
  MOE_TRY(fill_uniform(qkv, size_t(T) * W, 1.f, 0.f, ++seed));
  MOE_TRY(fill_uniform(router_logits, size_t(T) * E, 2.f, 0.f, ++seed));
  const size_t ws_bytes = moe::cuda::q4_grouped_workspace_bytes(lay, P, K, E);
  void* ws = nullptr;
  MOE_TRY(mem.alloc(reinterpret_cast<uint8_t**>(&ws), ws_bytes));
  auto made = moe::cuda::CublasLtMatmul::create();
  if (!made.ok()) return make_error(made.error());
  std::unique_ptr<moe::cuda::CublasLtMatmul> mm(made.value());

  // Decode routes: the D tokens' top_k slots on distinct experts (7 is prime
  // to both shapes' expert counts), weights 1/top_k.
  auto set_routes = [&](const std::vector<int32_t>& r) -> Status {
    MOE_CUDA_TRY(cudaMemcpy(ids, r.data(), r.size() * 4, cudaMemcpyHostToDevice));
    const std::vector<float> w(r.size(), 1.f / float(K));
    MOE_CUDA_TRY(cudaMemcpy(route_w, w.data(), w.size() * 4, cudaMemcpyHostToDevice));
    return {};
  };
  std::vector<int32_t> dec_routes(size_t(D) * K);
  for (size_t i = 0; i < dec_routes.size(); ++i) dec_routes[i] = int32_t((i * 7) % size_t(E));
  MOE_TRY(set_routes(dec_routes));
  auto args = [&](int l, int tokens) {
    moe::cuda::Q4ExpertArgs a;
    a.layout = lay;
    a.blobs = tables + size_t(l) * E;
    a.n_experts = E;
    a.expert_ids = ids;
    a.route_weights = route_w;
    a.tokens = tokens;
    a.top_k = K;
    return a;
  };
  // One call per layer in the graph (calls = nl), or one call (calls = 1).
  auto add = [&](const std::string& name, int calls, double bytes, double flops,
                 const std::function<Status(int l)>& call) -> Status {
    auto us = time_graph(
        [&]() -> Status {
          for (int l = 0; l < calls; ++l) MOE_TRY(call(l));
          return {};
        },
        10, 5, false, t);
    if (!us.ok()) return make_error(name + ": " + us.error());
    rows.push_back({"kernels", s.name, name, us.value() / calls, bytes, flops});
    print_row(rows.back());
    return {};
  };
  const double matrix = double(lay.gate.codes_bytes() + lay.gate.params_bytes());
  const std::string topk = " x top" + str(K);
  print_header("kernels alone (graph of one call per layer, median of 5 runs)", s);
  for (int n : {1, D}) {
    const double distinct = std::min(double(n) * K, double(E));
    MOE_TRY(add("q4 gate+up+SiLU, " + str(n) + " tok" + topk, nl, 2 * distinct * matrix,
                2.0 * n * K * 2.0 * H * I,
                [&](int l) { return moe::cuda::q4_expert_gate_up(args(l, n), xn, h, t.st); }));
    MOE_TRY(add("q4 down (weighted sum), " + str(n) + " tok" + topk, nl, distinct * matrix, 2.0 * n * K * H * I,
                [&](int l) { return moe::cuda::q4_expert_down(args(l, n), h, x, true, t.st); }));
  }
  for (int n : {1, D}) {
    MOE_TRY(add("bf16 GEMV lm_head, " + str(n) + " tok", 1, double(s.vocab) * H * 2, 2.0 * n * s.vocab * H,
                [&](int) {
                  return moe::cuda::dense_gemv_bf16(lm_head, xn, logits, n, s.vocab, H, false, nullptr, 0, t.st);
                }));
    MOE_TRY(add("bf16 GEMV qkv, " + str(n) + " tok", nl, double(W) * H * 2, 2.0 * n * W * H, [&](int l) {
      return moe::cuda::dense_gemv_bf16(qkv_w + size_t(l) * W * H, xn, qkv, n, W, H, false, nullptr, 0, t.st);
    }));
  }
  // The per-token kernels around them: one call per layer, inputs as a
  // decode step or a prompt has them.
  auto rope = [&](int l, int n, const int32_t* pos, const int32_t* seq) {
    moe::cuda::QkvRopeArgs ra;
    ra.qkv = qkv;
    ra.bias = bias;
    ra.q_norm = q_norm;
    ra.k_norm = k_norm;
    ra.eps = kEps;
    ra.positions = pos;
    ra.seq_of_token = seq;
    ra.inv_freq = inv_freq;
    ra.tokens = n;
    ra.n_heads = s.n_heads;
    ra.q_out = q;
    return moe::cuda::qkv_rope_store(ra, pool(l), t.st);
  };
  auto attend = [&](int l, int n, const int32_t* pos, const int32_t* seq,
                    moe::cuda::AttentionWalk walk = moe::cuda::AttentionWalk::per_query) {
    moe::cuda::AttentionArgs aa;
    aa.walk = walk;
    aa.q = q;
    aa.seq_of_token = seq;
    aa.positions = pos;
    aa.tokens = n;
    aa.n_heads = s.n_heads;
    aa.scale = 1.f / std::sqrt(float(hd));
    aa.out = attn;
    return moe::cuda::paged_attention(aa, pool(l), t.st);
  };
  const double kv_token = 2.0 * s.n_kv * hd * 2;  // bytes of one position's k and v
  for (int n : {1, D, P}) {
    const bool prompt = n == P;
    const int32_t* pos = prompt ? d_pre_pos : d_dec_pos;
    const int32_t* seq = prompt ? d_pre_seq : d_dec_seq;
    const std::string tok = ", " + str(n) + " tok";
    MOE_TRY(add("RMSNorm" + tok, nl, double(n) * H * 6 + H * 2, 0,
                [&](int) { return moe::cuda::rmsnorm(x, norm_w, xn, n, H, kEps, t.st); }));
    MOE_TRY(add("router softmax + top-k" + tok, nl, double(n) * E * 4, 0, [&](int) {
      return moe::cuda::router_topk(router_logits, n, E, K, s.norm_topk, 1.f, scratch_ids, scratch_w, t.st);
    }));
    MOE_TRY(add("uniform expert draw" + tok, nl, double(n) * K * 4, 0, [&](int l) {
      return moe::cuda::force_experts({pos, seq, l, 7}, scratch_ids, n, E, K, t.st);
    }));
    MOE_TRY(add("RoPE + KV store" + tok, nl, double(n) * W * 4 + double(n) * (QD * 2 + kv_token), 0,
                [&](int l) { return rope(l, n, pos, seq); }));
    // Keys read: every decode token its own C + 1, a prompt's P once; flops:
    // q.k and p.v over each query's keys.
    const double keys = prompt ? 0.5 * double(P) * (P + 1) : double(n) * (C + 1);
    MOE_TRY(add(prompt ? "paged attention (causal prompt)" + tok
                       : "paged attention, " + str(n) + " seq x " + str(C + 1) + " keys",
                nl, (prompt ? double(P) : double(n) * (C + 1)) * kv_token, 4.0 * s.n_heads * hd * keys,
                [&](int l) { return attend(l, n, pos, seq); }));
    if (prompt && moe::cuda::attention_query_tiles_supported(hd))
      MOE_TRY(add("paged attention (causal prompt, query tiles)" + tok, nl, double(P) * kv_token,
                  4.0 * s.n_heads * hd * keys,
                  [&](int l) { return attend(l, n, pos, seq, moe::cuda::AttentionWalk::query_tiles); }));
  }
  {
    // A prompt's routes: seeded random, every expert of a layer in use.
    std::vector<int32_t> r(size_t(P) * K);
    uint64_t g = 7;
    for (auto& v : r) {
      g = g * 6364136223846793005ull + 1442695040888963407ull;
      v = int32_t((g >> 33) % uint64_t(E));
    }
    MOE_TRY(set_routes(r));
    MOE_TRY(add("grouped q4 MoE GEMM, " + str(P) + " tok", nl, double(E) * 3 * matrix, 2.0 * P * K * 3.0 * H * I,
                [&](int l) { return moe::cuda::q4_grouped_moe(args(l, P), xn, x, ws, ws_bytes, t.st); }));
    MOE_TRY(add("cuBLASLt bf16 qkv, " + str(P) + " tok", nl, double(W) * H * 2, 2.0 * P * W * H, [&](int l) {
      return mm->matmul(xn, qkv_w + size_t(l) * W * H, qkv, true, P, W, H, 0.f, t.st);
    }));
  }
  MOE_CUDA_TRY(cudaStreamSynchronize(t.st));
  return {};
}

// ---- dense: the decode GEMVs in each weight dtype ----

Status bench_dense(const ModelShape& s, Timer& t, std::vector<Row>& rows) {
  struct Matrix {
    const char* name;
    int rows, cols;
  };
  const int H = s.hidden, W = (s.n_heads + 2 * s.n_kv) * s.head_dim, QD = s.n_heads * s.head_dim;
  const Matrix matrices[] = {{"qkv", W, H}, {"o", H, QD}, {"router", s.n_experts, H}, {"lm_head", s.vocab, H}};
  const int D = moe::cuda::kGemvMaxTokens;
  print_header("dense decode GEMVs (200 launches of one matrix, best of 5)", s);
  uint64_t seed = 99;
  for (const Matrix& m : matrices) {
    DeviceMemory mem;
    const size_t n = size_t(m.rows) * m.cols;
    // The weights once in f32 (the INT4 quantiser's input), then each dtype.
    std::vector<float> w(n);
    for (float& v : w) v = 0.04f * (next_unit(seed) - 0.5f);
    std::vector<bf16> wb(n);
    for (size_t i = 0; i < n; ++i) wb[i] = __float2bfloat16(w[i]);
    const moe::Q4MatrixLayout q4 = moe::q4_matrix_layout(m.rows, m.cols, kGroup);
    std::vector<uint8_t> blob(moe::q4_matrix_bytes(q4));
    moe::q4_quantize_matrix(w.data(), q4, blob.data());
    w = {};
    bf16* dwb = nullptr;
    uint8_t* d4 = nullptr;
    int8_t* dq = nullptr;
    float* ds = nullptr;
    MOE_TRY(upload(mem, &dwb, wb));
    wb = {};
    MOE_TRY(upload(mem, &d4, blob));
    MOE_TRY(mem.alloc(&dq, n));
    MOE_TRY(mem.alloc(&ds, size_t(m.rows)));
    MOE_TRY(moe::cuda::quantize_rows_i8(dwb, m.rows, m.cols, dq, ds, t.st));
    bf16 *x = nullptr, *nw = nullptr;
    float *xf = nullptr, *y = nullptr;
    MOE_TRY(mem.alloc(&x, size_t(D) * m.cols));
    MOE_TRY(mem.alloc(&xf, size_t(D) * m.cols));
    MOE_TRY(mem.alloc(&nw, size_t(m.cols)));
    MOE_TRY(mem.alloc(&y, size_t(D) * m.rows));
    MOE_TRY(fill_uniform(x, size_t(D) * m.cols, 1.f, 0.f, ++seed));
    MOE_TRY(fill_uniform(xf, size_t(D) * m.cols, 1.f, 0.f, ++seed));
    MOE_TRY(fill_uniform(nw, size_t(m.cols), 0.1f, 1.f, ++seed));
    for (const std::string dt : {"bf16", "int8", "int4"}) {
      const double bytes = dt == "bf16" ? 2.0 * n : dt == "int8" ? double(n) + 4.0 * m.rows : double(blob.size());
      for (int tokens : {1, D})
        for (bool norm : {false, true}) {
          auto launch = [&]() -> Status {
            namespace c = moe::cuda;
            if (dt == "bf16")
              return norm ? c::dense_gemv_bf16_rmsnorm(dwb, xf, nw, kEps, nullptr, y, tokens, m.rows, m.cols, false,
                                                       nullptr, 0, t.st)
                          : c::dense_gemv_bf16(dwb, x, y, tokens, m.rows, m.cols, false, nullptr, 0, t.st);
            if (dt == "int8")
              return norm ? c::dense_gemv_i8_rmsnorm(dq, ds, xf, nw, kEps, nullptr, y, tokens, m.rows, m.cols, false,
                                                     nullptr, 0, t.st)
                          : c::dense_gemv_i8(dq, ds, x, y, tokens, m.rows, m.cols, false, nullptr, 0, t.st);
            return norm ? c::dense_gemv_q4_rmsnorm(d4, q4, xf, nw, kEps, nullptr, y, tokens, false, nullptr, 0, t.st)
                        : c::dense_gemv_q4(d4, q4, x, y, tokens, false, nullptr, 0, t.st);
          };
          constexpr int kLaunches = 200;
          auto us = time_graph(
              [&]() -> Status {
                for (int i = 0; i < kLaunches; ++i) MOE_TRY(launch());
                return {};
              },
              1, 5, true, t);
          const std::string name = std::string(m.name) + " " + str(m.rows) + "x" + str(m.cols) + " " + dt + ", " +
                                   str(tokens) + " tok" + (norm ? ", rmsnorm input" : "");
          if (!us.ok()) return make_error(name + ": " + us.error());
          rows.push_back({"dense", s.name, name, us.value() / kLaunches, bytes, 2.0 * tokens * double(n)});
          print_row(rows.back());
        }
    }
    MOE_CUDA_TRY(cudaStreamSynchronize(t.st));
  }
  return {};
}

// ---- copy: the host-to-device link alone ----

Status bench_copy(const ModelShape& s, Timer& t, std::vector<Row>& rows) {
  const size_t blob = moe::expert_layout(s.hidden, s.inter, kGroup).blob_bytes;
  const int n = std::max(1, int(1.6e9 / double(blob)));
  const size_t bytes = blob * size_t(n), page = 4096, padded = (bytes + page - 1) / page * page;
  print_header("host-to-device copies of one expert blob, one stream (median of 3 runs)", s);
  DeviceMemory mem;
  uint8_t* dev = nullptr;
  MOE_TRY(mem.alloc(&dev, bytes));
  auto time_from = [&](const uint8_t* host, const std::string& what) -> Status {
    std::vector<double> ms;
    for (int r = 0; r < 3; ++r) {
      MOE_CUDA_TRY(cudaEventRecord(t.a, t.st));
      for (int i = 0; i < n; ++i)
        MOE_CUDA_TRY(cudaMemcpyAsync(dev + size_t(i) * blob, host + size_t(i) * blob, blob, cudaMemcpyHostToDevice,
                                     t.st));
      MOE_CUDA_TRY(cudaEventRecord(t.b, t.st));
      MOE_CUDA_TRY(cudaEventSynchronize(t.b));
      float v = 0;
      MOE_CUDA_TRY(cudaEventElapsedTime(&v, t.a, t.b));
      ms.push_back(v);
    }
    std::sort(ms.begin(), ms.end());
    rows.push_back({"copy", s.name, "H2D " + str(n) + " x " + std::to_string(blob) + " B, " + what,
                    ms[1] * 1000.0 / n, double(blob), 0});
    print_row(rows.back());
    return {};
  };
  {
    // malloc'd memory pinned in place, as the worker pins expert files.
    struct HostFree {
      void operator()(uint8_t* p) const { std::free(p); }
    };
    std::unique_ptr<uint8_t, HostFree> reg(static_cast<uint8_t*>(std::aligned_alloc(page, padded)));
    if (!reg) return make_error("no host memory for " + std::to_string(padded) + " bytes");
    std::memset(reg.get(), 1, padded);
    MOE_CUDA_TRY(cudaHostRegister(reg.get(), padded, cudaHostRegisterPortable | cudaHostRegisterReadOnly));
    const Status st = time_from(reg.get(), "registered in place");
    MOE_CUDA_TRY(cudaHostUnregister(reg.get()));
    MOE_TRY(st);
  }
  uint8_t* pinned = nullptr;
  MOE_CUDA_TRY(cudaMallocHost(reinterpret_cast<void**>(&pinned), bytes));
  std::memset(pinned, 1, bytes);
  const Status st = time_from(pinned, "cudaMallocHost");
  MOE_CUDA_TRY(cudaFreeHost(pinned));
  return st;
}

int usage() {
  std::fprintf(stderr,
               "usage: moe-bench-kernels [--shape qwen15|qwen3|all] [--only kernels,dense,copy] [--layers N]\n"
               "                         [--context N] [--prompt N] [--json PATH] [--commit HASH]\n");
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (i + 1 >= argc) return usage();
    const std::string v = argv[++i];
    if (a == "--shape") {
      o.shape = v;
    } else if (a == "--only") {
      o.kernels = o.dense = o.copy = false;
      for (size_t at = 0; at <= v.size();) {
        const size_t end = std::min(v.find(',', at), v.size());
        const std::string w = v.substr(at, end - at);
        if (w == "kernels")
          o.kernels = true;
        else if (w == "dense")
          o.dense = true;
        else if (w == "copy")
          o.copy = true;
        else
          return usage();
        at = end + 1;
      }
    } else if (a == "--layers") {
      o.layers = std::atoi(v.c_str());
    } else if (a == "--context") {
      o.context = std::atoi(v.c_str());
    } else if (a == "--prompt") {
      o.prompt = std::atoi(v.c_str());
    } else if (a == "--json") {
      o.json = v;
    } else if (a == "--commit") {
      o.commit = v;
    } else {
      return usage();
    }
  }
  if (o.context < 1 || o.prompt < 1 || o.layers < 0) return usage();
  std::vector<ModelShape> shapes;
  if (o.shape == "qwen15" || o.shape == "all") shapes.push_back(moe::bench::qwen15_moe_a27b());
  if (o.shape == "qwen3" || o.shape == "all") shapes.push_back(moe::bench::qwen3_30b_a3b());
  if (shapes.empty()) return usage();
  int devices = 0;
  const cudaError_t e = cudaGetDeviceCount(&devices);
  if (e != cudaSuccess || devices == 0) {
    std::printf("SKIPPED: no CUDA device (%s)\n", e != cudaSuccess ? cudaGetErrorString(e) : "none found");
    return 0;
  }
  cudaDeviceProp prop{};
  if (cudaGetDeviceProperties(&prop, 0) != cudaSuccess) {
    std::fprintf(stderr, "error: cannot read the device's properties\n");
    return 1;
  }
  std::printf("moe-bench-kernels on %s (L2 %d MiB), commit %s\n", prop.name, prop.l2CacheSize >> 20,
              o.commit.c_str());
  Timer t;
  if (cudaStreamCreateWithFlags(&t.st, cudaStreamNonBlocking) != cudaSuccess || cudaEventCreate(&t.a) != cudaSuccess ||
      cudaEventCreate(&t.b) != cudaSuccess) {
    std::fprintf(stderr, "error: cannot create a stream and events\n");
    return 1;
  }
  std::vector<Row> rows;
  for (const ModelShape& s : shapes) {
    Status st;
    if (st.ok() && o.kernels) st = bench_kernels(s, o, t, rows);
    if (st.ok() && o.dense) st = bench_dense(s, t, rows);
    if (st.ok() && o.copy) st = bench_copy(s, t, rows);
    if (!st.ok()) {
      std::fprintf(stderr, "error: %s: %s\n", s.name.c_str(), st.error().c_str());
      return 1;
    }
  }
  if (!o.json.empty()) {
    char date[32];
    const std::time_t now = std::time(nullptr);
    std::strftime(date, sizeof date, "%Y-%m-%d", std::gmtime(&now));
    nlohmann::json j;
    j["date"] = date;
    j["gpu"] = prop.name;
    j["commit"] = o.commit;
    j["settings"] = {{"layers", o.layers > 0 ? nlohmann::json(o.layers) : nlohmann::json("the shape's")},
                     {"context", o.context},
                     {"prompt", o.prompt},
                     {"expert_group", kGroup},
                     {"kernels", "one graph of one call per layer, 10 replays a run, median of 5 runs"},
                     {"dense", "200 launches of one matrix in a graph, best of 5 replays"},
                     {"copy", "back-to-back host-to-device copies of one expert blob, median of 3 runs"}};
    j["rows"] = nlohmann::json::array();
    for (const Row& r : rows) {
      const double sec = r.us * 1e-6;
      j["rows"].push_back({{"section", r.section},
                           {"shape", r.shape},
                           {"kernel", r.kernel},
                           {"us", r.us},
                           {"bytes", r.bytes},
                           {"flops", r.flops},
                           {"gb_s", r.bytes / sec / 1e9},
                           {"tflop_s", r.flops / sec / 1e12}});
    }
    std::ofstream out(o.json);
    out << j.dump(2) << "\n";
    if (!out) {
      std::fprintf(stderr, "error: cannot write %s\n", o.json.c_str());
      return 1;
    }
  }
  return 0;
}
