// moe-bench-gpu: decode and prefill speed of two real MoE shapes with random
// weights, all experts resident on the GPU (INT4, group 64; the rest bf16).
//   moe-bench-gpu [--shape qwen15|qwen3|all] [--steps N] [--context N]
//                 [--prompt N] [--json PATH] [--no-kernels]
//                 [--vram-budget 12GiB[,8GiB...]] [--policy lru|lfu|ours]
//                 [--predict-accuracy A[,B...]] [--warm-steps N]
// With --vram-budget the experts live in pinned host memory and each budget
// gets an arena of expert islands (bench/gpu/budget_experts.h): batch-1
// decode and a prefill under that budget, seeded uniform routing.
// Decode: one CUDA graph per step, replayed `steps` times from `context`
// tokens of context; the step's greedy token feeds the next step on the GPU.
#include <cuda_runtime.h>
#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "bench/gpu/bench_model.h"
#include "bench/gpu/budget_experts.h"

namespace {

using moe::Status;
using moe::bench::BenchModel;
using moe::bench::ModelShape;

struct Options {
  std::string shape = "all";
  int steps = 128, context = 128, prompt = 512;
  int fuse_max_batch = 4;
  std::string json;
  std::string commit = MOE_BENCH_COMMIT;  // the configure-time commit unless --commit
  bool kernels = true;
  std::vector<double> budgets_gib;         // empty: all experts resident
  std::vector<double> accuracies = {0.8};  // the first is the headline row
  std::string policy = "ours";
  int warm_steps = 64;
  bool huge_pages = true;
  bool batched_prefetch = true;
  bool copy_test = false;
  int prefill_lookahead = 4;
};

struct Row {
  std::string shape, phase;
  int batch = 0;
  double tok_s = 0, ms = 0, gbps = 0;
  double peak_mib = 0;
  double transformers = -1;  // -1: not measured
  // Budget modes only.
  std::string mode = "resident";
  double hit_rate = 1.0, pcie_bytes_per_token = 0, misses_per_token = 0, accuracy = -1;
  int64_t islands = 0;
};

double used_mib() {
  size_t free_b = 0, total_b = 0;
  if (cudaMemGetInfo(&free_b, &total_b) != cudaSuccess) return 0;
  return double(total_b - free_b) / (1024.0 * 1024.0);
}

// The side-by-side peer, measured on the same H200 (shared/docs/GPU.md):
// transformers 5.17, bf16, all on GPU, greedy generate after a 128-token prompt.
double transformers_figure(const std::string& shape, int batch) {
  if (shape == "Qwen1.5-MoE-A2.7B") return batch == 1 ? 32.5 : 138.6;
  if (shape == "Qwen3-30B-A3B") return batch == 1 ? 13.9 : 94.0;
  return -1;
}

#define MAIN_TRY(expr)                                          \
  do {                                                          \
    Status st_ = (expr);                                        \
    if (!st_.ok()) {                                            \
      std::fprintf(stderr, "error: %s\n", st_.error().c_str()); \
      return false;                                             \
    }                                                           \
  } while (0)

#define CU_TRY(expr)                                                                            \
  do {                                                                                          \
    cudaError_t e_ = (expr);                                                                    \
    if (e_ != cudaSuccess) {                                                                    \
      std::fprintf(stderr, "error: %s at %s:%d\n", cudaGetErrorString(e_), __FILE__, __LINE__); \
      return false;                                                                             \
    }                                                                                           \
  } while (0)

bool bench_shape(const ModelShape& s, const Options& o, std::vector<Row>& rows,
                 nlohmann::json& kernels) {
  cudaStream_t st;
  CU_TRY(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  const int max_context = std::max(o.context + o.steps * 4 + 16, o.prompt + 16);
  std::printf("== %s: building random weights on the GPU...\n", s.name.c_str());
  std::fflush(stdout);
  auto made = BenchModel::create(s, std::max(o.prompt, 8), 8, max_context, 1234, st);
  if (!made.ok()) {
    std::fprintf(stderr, "error: %s\n", made.error().c_str());
    return false;
  }
  std::unique_ptr<BenchModel> m = std::move(made.value());
  m->set_fuse_max_batch(o.fuse_max_batch);
  double peak = used_mib();
  std::printf("   resident: %.0f MiB of GPU memory in use\n", peak);
  cudaEvent_t a, b;
  CU_TRY(cudaEventCreate(&a));
  CU_TRY(cudaEventCreate(&b));

  for (int batch : {1, 8}) {
    // Eager step first: kernel attributes are set outside the capture.
    MAIN_TRY(m->set_positions(o.context, batch));
    MAIN_TRY(m->decode_step(batch, st));
    CU_TRY(cudaStreamSynchronize(st));
    cudaGraph_t g;
    cudaGraphExec_t ge;
    CU_TRY(cudaStreamBeginCapture(st, cudaStreamCaptureModeRelaxed));
    Status cap = m->decode_step(batch, st);
    CU_TRY(cudaStreamEndCapture(st, &g));
    MAIN_TRY(cap);
    CU_TRY(cudaGraphInstantiate(&ge, g, 0));
    std::vector<double> runs;
    for (int r = 0; r < 4; ++r) {
      MAIN_TRY(m->set_positions(o.context, batch));
      CU_TRY(cudaGraphLaunch(ge, st));  // warm
      CU_TRY(cudaEventRecord(a, st));
      for (int i = 0; i < o.steps; ++i) CU_TRY(cudaGraphLaunch(ge, st));
      CU_TRY(cudaEventRecord(b, st));
      CU_TRY(cudaEventSynchronize(b));
      float ms = 0;
      CU_TRY(cudaEventElapsedTime(&ms, a, b));
      if (r > 0) runs.push_back(ms / o.steps);  // the first run warms clocks
    }
    std::sort(runs.begin(), runs.end());
    const double step_ms = runs[runs.size() / 2];
    peak = std::max(peak, used_mib());
    Row row;
    row.shape = s.name;
    row.phase = "decode";
    row.batch = batch;
    row.ms = step_ms;
    row.tok_s = batch * 1000.0 / step_ms;
    row.gbps = moe::bench::decode_bytes_per_step(s, m->layout(), batch) / (step_ms * 1e-3) / 1e9;
    row.transformers = transformers_figure(s.name, batch);
    rows.push_back(row);
    std::printf("   decode batch %d: %.3f ms/step, %.1f tok/s (%.0f GB/s of weights)\n", batch,
                step_ms, row.tok_s, row.gbps);
    std::fflush(stdout);
    cudaGraphExecDestroy(ge);
    cudaGraphDestroy(g);
  }

  {
    MAIN_TRY(m->prefill(o.prompt, st));  // warm-up, cuBLASLt algorithm choice
    CU_TRY(cudaStreamSynchronize(st));
    std::vector<double> runs;
    for (int r = 0; r < 5; ++r) {
      CU_TRY(cudaEventRecord(a, st));
      MAIN_TRY(m->prefill(o.prompt, st));
      CU_TRY(cudaEventRecord(b, st));
      CU_TRY(cudaEventSynchronize(b));
      float ms = 0;
      CU_TRY(cudaEventElapsedTime(&ms, a, b));
      runs.push_back(ms);
    }
    std::sort(runs.begin(), runs.end());
    peak = std::max(peak, used_mib());
    Row row;
    row.shape = s.name;
    row.phase = "prefill";
    row.batch = o.prompt;
    row.ms = runs[runs.size() / 2];
    row.tok_s = o.prompt * 1000.0 / row.ms;
    rows.push_back(row);
    std::printf("   prefill %d: %.2f ms, %.0f tok/s\n", o.prompt, row.ms, row.tok_s);
    std::fflush(stdout);
  }
  for (Row& r : rows)
    if (r.shape == s.name) r.peak_mib = peak;

  if (o.kernels) {
    auto t = m->time_kernels(st);
    if (!t.ok()) {
      std::fprintf(stderr, "error: %s\n", t.error().c_str());
      return false;
    }
    std::printf("   %-44s %10s %10s %10s\n", "kernel", "us/call", "GB/s", "TFLOP/s");
    for (const auto& k : t.value()) {
      const double gbps = k.bytes / (k.us * 1e-6) / 1e9, tf = k.flops / (k.us * 1e-6) / 1e12;
      std::printf("   %-44s %10.2f %10.0f %10.1f\n", k.name.c_str(), k.us, gbps, tf);
      kernels.push_back(
          {{"shape", s.name}, {"kernel", k.name}, {"us", k.us}, {"gb_s", gbps}, {"tflop_s", tf}});
    }
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  m.reset();
  cudaStreamDestroy(st);
  return true;
}

std::vector<double> parse_list(const std::string& s, bool gib) {
  std::vector<double> v;
  size_t i = 0;
  while (i < s.size()) {
    size_t j = s.find(',', i);
    if (j == std::string::npos) j = s.size();
    std::string t = s.substr(i, j - i);
    if (gib && t.size() > 3 && t.substr(t.size() - 3) == "GiB") t.resize(t.size() - 3);
    v.push_back(std::stod(t));
    i = j + 1;
  }
  return v;
}

std::string gib_name(double g) {
  char b[32];
  std::snprintf(b, sizeof b, "budget-%gGiB", g);
  return b;
}

// Experts in pinned host memory, an island arena per budget: batch-1 decode
// (eager, one host wait per layer at the router point) and a prefill.
bool bench_budget(const ModelShape& s, const Options& o, std::vector<Row>& rows) {
  cudaStream_t st;
  CU_TRY(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  const moe::ExpertLayout lay = moe::expert_layout(s.hidden, s.inter, 64);
  const size_t total = size_t(s.layers) * s.n_experts * lay.blob_bytes;
  // 2 MiB pages: the copy engine reads pinned memory through fewer page mappings.
  const size_t page = size_t(2) << 20, alloc_bytes = (total + page - 1) / page * page;
  uint8_t* host = static_cast<uint8_t*>(std::aligned_alloc(page, alloc_bytes));
  if (!host) {
    std::fprintf(stderr, "error: no host memory for %zu bytes of experts\n", total);
    return false;
  }
  if (o.huge_pages) (void)madvise(host, alloc_bytes, MADV_HUGEPAGE);
  std::printf("== %s under budgets: experts in host memory (%.2f GiB, %zu-byte blobs)...\n",
              s.name.c_str(), double(total) / (1ull << 30), lay.blob_bytes);
  std::fflush(stdout);
  const int max_context = o.context + o.warm_steps + o.steps + std::max(o.prompt, 64) + 32;
  auto made = BenchModel::create(s, std::max(o.prompt, 8), 1, max_context, 1234, st, host);
  if (!made.ok()) {
    std::fprintf(stderr, "error: %s\n", made.error().c_str());
    std::free(host);
    return false;
  }
  std::unique_ptr<BenchModel> m = std::move(made.value());
  m->set_fuse_max_batch(o.fuse_max_batch);
  const double base_mib = used_mib();
  std::printf(
      "   without experts: %.0f MiB of GPU memory in use (context, bf16 non-expert weights, KV, "
      "workspace)\n",
      base_mib);
  bool ok = true;
  for (double gib : o.budgets_gib) {
    const double margin_mib = 160;  // routing packs, cuBLASLt and launch bookkeeping
    const double islands_mib = gib * 1024.0 - base_mib - margin_mib;
    const double need_mib = double(s.n_experts) * lay.blob_bytes / (1 << 20);
    if (islands_mib < need_mib) {
      std::printf(
          "   %s: refused: %.0f MiB in use before experts leaves %.0f MiB, one layer's experts "
          "need "
          "%.0f MiB; a budget of %.2f GiB would fit\n",
          gib_name(gib).c_str(), base_mib, islands_mib, need_mib,
          (base_mib + margin_mib + need_mib) / 1024.0);
      continue;
    }
    for (size_t ai = 0; ai < o.accuracies.size(); ++ai) {
      moe::bench::BudgetOptions bo;
      bo.islands_bytes = size_t(islands_mib * 1024 * 1024);
      bo.n_layers = s.layers;
      bo.n_experts = s.n_experts;
      bo.top_k = s.top_k;
      bo.max_tokens = std::max(o.prompt, 8);
      bo.blob_bytes = lay.blob_bytes;
      bo.host_experts = host;
      bo.policy = o.policy;
      bo.predict_accuracy = o.accuracies[ai];
      bo.batched_prefetch = o.batched_prefetch;
      bo.prefill_lookahead = o.prefill_lookahead;
      auto be = moe::bench::BudgetExperts::create(bo);
      if (!be.ok()) {
        std::fprintf(stderr, "error: %s\n", be.error().c_str());
        ok = false;
        break;
      }
      std::unique_ptr<moe::bench::BudgetExperts> prov = std::move(be.value());
      m->set_provider(prov.get());
      double peak = used_mib();
      const int64_t n_isl = prov->n_islands();
      std::printf(
          "   %s, policy %s, prediction accuracy %.2f: %lld islands (%.1f%% of %d experts), host "
          "experts %s\n",
          gib_name(gib).c_str(), o.policy.c_str(), bo.predict_accuracy, (long long)n_isl,
          100.0 * double(n_isl) / (double(s.layers) * s.n_experts), s.layers * s.n_experts,
          prov->host_registered() ? "pinned in place" : "copied to page-locked memory");
      std::fflush(stdout);
      // Decode, batch 1: warm the islands to their steady state, then time.
      MAIN_TRY(m->set_positions(o.context, 1));
      for (int i = 0; i < o.warm_steps; ++i) {
        prov->begin_step();
        MAIN_TRY(m->decode_step(1, st));
      }
      CU_TRY(cudaStreamSynchronize(st));
      const moe::ResidencyStats s0 = prov->stats();
      const auto t0 = std::chrono::steady_clock::now();
      for (int i = 0; i < o.steps; ++i) {
        prov->begin_step();
        MAIN_TRY(m->decode_step(1, st));
      }
      CU_TRY(cudaStreamSynchronize(st));
      const double dec_s =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      const moe::ResidencyStats s1 = prov->stats();
      peak = std::max(peak, used_mib());
      Row r;
      r.shape = s.name;
      r.mode = gib_name(gib);
      r.phase = "decode";
      r.batch = 1;
      r.ms = dec_s * 1000.0 / o.steps;
      r.tok_s = o.steps / dec_s;
      const double acq = double((s1.hits - s0.hits) + (s1.misses - s0.misses));
      r.hit_rate = acq > 0 ? double(s1.hits - s0.hits) / acq : 0;
      r.pcie_bytes_per_token = double(s1.bytes_copied - s0.bytes_copied) / o.steps;
      r.misses_per_token = double(s1.misses - s0.misses) / o.steps;
      r.accuracy = bo.predict_accuracy;
      r.islands = n_isl;
      std::printf(
          "   decode batch 1: %.3f ms/token, %.1f tok/s, hit rate %.3f, %.1f demand misses/token, "
          "%.1f MB over PCIe/token (prefetches %llu)\n",
          r.ms, r.tok_s, r.hit_rate, r.misses_per_token, r.pcie_bytes_per_token / 1e6,
          (unsigned long long)(s1.prefetches - s0.prefetches));
      std::fflush(stdout);
      if (ai == 0) {
        // Prefill under the same islands (the headline accuracy only).
        prov->begin_step();
        MAIN_TRY(m->prefill(o.prompt, st));
        CU_TRY(cudaStreamSynchronize(st));
        const moe::ResidencyStats p0 = prov->stats();
        std::vector<double> runs;
        for (int k = 0; k < 3; ++k) {
          prov->begin_step();
          const auto a = std::chrono::steady_clock::now();
          MAIN_TRY(m->prefill(o.prompt, st));
          CU_TRY(cudaStreamSynchronize(st));
          runs.push_back(
              std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - a)
                  .count());
        }
        const moe::ResidencyStats p1 = prov->stats();
        std::sort(runs.begin(), runs.end());
        peak = std::max(peak, used_mib());
        Row q = r;
        q.phase = "prefill";
        q.batch = o.prompt;
        q.ms = runs[1];
        q.tok_s = o.prompt * 1000.0 / q.ms;
        const double pacq = double((p1.hits - p0.hits) + (p1.misses - p0.misses));
        q.hit_rate = pacq > 0 ? double(p1.hits - p0.hits) / pacq : 0;
        q.pcie_bytes_per_token = double(p1.bytes_copied - p0.bytes_copied) / (3.0 * o.prompt);
        q.misses_per_token = double(p1.misses - p0.misses) / (3.0 * o.prompt);
        q.peak_mib = peak;
        r.peak_mib = peak;
        std::printf(
            "   prefill %d: %.2f ms, %.0f tok/s, hit rate %.3f, %.0f MB over PCIe per prompt\n",
            o.prompt, q.ms, q.tok_s, q.hit_rate, q.pcie_bytes_per_token * o.prompt / 1e6);
        rows.push_back(r);
        rows.push_back(q);
      } else {
        r.peak_mib = peak;
        rows.push_back(r);
      }
      std::printf("   peak %.0f MiB of GPU memory in use (budget %.0f MiB)\n", peak, gib * 1024.0);
      std::fflush(stdout);
      m->set_provider(nullptr);
      prov.reset();
    }
  }
  m.reset();
  std::free(host);
  cudaStreamDestroy(st);
  return ok;
}

// The link alone: n back-to-back copies of `blob` bytes from host memory
// that is (a) malloc'd and registered in place, as the arena pins expert
// files, (b) cudaMallocHost'd; one copy stream, nothing else running.
bool bench_copies(size_t blob, int n) {
  const size_t bytes = blob * size_t(n), page = 4096, ab = (bytes + page - 1) / page * page;
  uint8_t* dev = nullptr;
  CU_TRY(cudaMalloc(reinterpret_cast<void**>(&dev), bytes));
  cudaStream_t cs;
  CU_TRY(cudaStreamCreateWithFlags(&cs, cudaStreamNonBlocking));
  cudaEvent_t a, b;
  CU_TRY(cudaEventCreate(&a));
  CU_TRY(cudaEventCreate(&b));
  auto time_from = [&](const uint8_t* host, const char* what) -> bool {
    for (int r = 0; r < 3; ++r) {
      CU_TRY(cudaEventRecord(a, cs));
      for (int i = 0; i < n; ++i)
        CU_TRY(cudaMemcpyAsync(dev + size_t(i) * blob, host + size_t(i) * blob, blob,
                               cudaMemcpyHostToDevice, cs));
      CU_TRY(cudaEventRecord(b, cs));
      CU_TRY(cudaEventSynchronize(b));
      float ms = 0;
      CU_TRY(cudaEventElapsedTime(&ms, a, b));
      std::printf("   copy test, %s: %d x %zu bytes in %.2f ms = %.1f GB/s (%.1f us a copy)\n",
                  what, n, blob, ms, double(bytes) / (ms * 1e-3) / 1e9, ms * 1000.0 / n);
    }
    return true;
  };
  uint8_t* reg = static_cast<uint8_t*>(std::aligned_alloc(page, ab));
  std::memset(reg, 1, ab);
  CU_TRY(cudaHostRegister(reg, ab, cudaHostRegisterPortable | cudaHostRegisterReadOnly));
  const bool ok1 = time_from(reg, "registered malloc");
  CU_TRY(cudaHostUnregister(reg));
  std::free(reg);
  uint8_t* pinned = nullptr;
  CU_TRY(cudaMallocHost(reinterpret_cast<void**>(&pinned), bytes));
  std::memset(pinned, 1, bytes);
  const bool ok2 = time_from(pinned, "cudaMallocHost");
  CU_TRY(cudaFreeHost(pinned));
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  cudaStreamDestroy(cs);
  cudaFree(dev);
  std::fflush(stdout);
  return ok1 && ok2;
}
}  // namespace

int main(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> std::string { return i + 1 < argc ? argv[++i] : ""; };
    if (a == "--shape")
      o.shape = next();
    else if (a == "--steps")
      o.steps = std::stoi(next());
    else if (a == "--context")
      o.context = std::stoi(next());
    else if (a == "--prompt")
      o.prompt = std::stoi(next());
    else if (a == "--json")
      o.json = next();
    else if (a == "--commit")
      o.commit = next();
    else if (a == "--fuse-max-batch")
      o.fuse_max_batch = std::stoi(next());
    else if (a == "--no-kernels")
      o.kernels = false;
    else if (a == "--vram-budget")
      o.budgets_gib = parse_list(next(), true);
    else if (a == "--predict-accuracy")
      o.accuracies = parse_list(next(), false);
    else if (a == "--policy")
      o.policy = next();
    else if (a == "--warm-steps")
      o.warm_steps = std::stoi(next());
    else if (a == "--no-huge-pages")
      o.huge_pages = false;
    else if (a == "--per-expert-prefetch")
      o.batched_prefetch = false;
    else if (a == "--copy-test")
      o.copy_test = true;
    else if (a == "--prefill-lookahead")
      o.prefill_lookahead = std::stoi(next());
    else {
      std::fprintf(
          stderr,
          "usage: moe-bench-gpu [--shape qwen15|qwen3|all] [--steps N] [--context N] "
          "[--prompt N] [--json PATH] [--commit HASH] [--fuse-max-batch N] [--no-kernels]\n"
          "       [--vram-budget 12GiB[,8GiB]] [--predict-accuracy A[,B]] [--policy lru|lfu|ours] "
          "[--warm-steps N]\n");
      return 2;
    }
  }
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
    std::printf("SKIPPED: no CUDA device\n");
    return 0;
  }
  cudaDeviceProp prop{};
  cudaGetDeviceProperties(&prop, 0);
  if (o.copy_test) {
    // Blob sizes of the two shapes' INT4 experts, ~1.6 GB each.
    const bool ok = bench_copies(2654208, 600) && bench_copies(4866048, 330);
    return ok ? 0 : 1;
  }
  std::vector<ModelShape> shapes;
  if (o.shape == "qwen15" || o.shape == "all") shapes.push_back(moe::bench::qwen15_moe_a27b());
  if (o.shape == "qwen3" || o.shape == "all") shapes.push_back(moe::bench::qwen3_30b_a3b());
  std::vector<Row> rows;
  nlohmann::json kernels = nlohmann::json::array();
  bool ok = true;
  for (const auto& s : shapes)
    ok =
        (o.budgets_gib.empty() ? bench_shape(s, o, rows, kernels) : bench_budget(s, o, rows)) && ok;

  std::printf("\n%s, decode from %d tokens of context (%d steps%s), prefill %d tokens\n", prop.name,
              o.context, o.steps, o.budgets_gib.empty() ? ", CUDA graph" : ", eager", o.prompt);
  std::printf("%-20s %-14s %-8s %6s %10s %12s %14s %10s %8s %12s %6s\n", "shape", "mode", "phase",
              "batch", "ms", "ours tok/s", "transformers", "peak MiB", "hit", "PCIe MB/tok",
              "pred");
  for (const Row& r : rows) {
    char tf[32] = "-";
    if (r.transformers > 0) std::snprintf(tf, sizeof tf, "%.1f", r.transformers);
    std::printf("%-20s %-14s %-8s %6d %10.3f %12.1f %14s %10.0f %8.3f %12.2f %6.2f\n",
                r.shape.c_str(), r.mode.c_str(), r.phase.c_str(), r.batch, r.ms, r.tok_s, tf,
                r.peak_mib, r.hit_rate, r.pcie_bytes_per_token / 1e6, r.accuracy);
  }
  if (!o.json.empty()) {
    char date[32];
    const std::time_t now = std::time(nullptr);
    std::strftime(date, sizeof date, "%Y-%m-%d", std::gmtime(&now));
    nlohmann::json j;
    if (!o.budgets_gib.empty()) {
      // Budget rows join the file's resident rows (and replace earlier budget rows of the same
      // key).
      std::ifstream in(o.json);
      if (in) j = nlohmann::json::parse(in, nullptr, false);
      if (j.is_discarded() || !j.is_object()) j = nlohmann::json::object();
      if (!j.contains("rows")) j["rows"] = nlohmann::json::array();
      nlohmann::json kept = nlohmann::json::array();
      for (const auto& x : j["rows"]) {
        bool replaced = false;
        for (const Row& r : rows)
          replaced =
              replaced ||
              (x.value("shape", "") == r.shape && x.value("mode", "") == r.mode &&
               x.value("phase", "") == r.phase && x.value("predict_accuracy", -1.0) == r.accuracy &&
               x.value("policy", "") == o.policy);
        if (!replaced) kept.push_back(x);
      }
      j["rows"] = kept;
      j["budget_settings"] = {
          {"date", date},
          {"commit", o.commit},
          {"gpu", prop.name},
          {"context", o.context},
          {"steps", o.steps},
          {"warm_steps", o.warm_steps},
          {"prompt", o.prompt},
          {"policy", o.policy},
          {"prefetch", o.batched_prefetch ? "batched" : "per expert"},
          {"prefill_lookahead_layers", o.prefill_lookahead},
          {"routing", "seeded uniform random, top-k distinct"},
          {"decode", "eager launches, one host wait per layer at the router point"},
          {"other_weights", "bf16"},
          {"prediction", "next layer's picks guessed right with probability predict_accuracy"}};
      for (const Row& r : rows)
        j["rows"].push_back({{"shape", r.shape},
                             {"mode", r.mode},
                             {"phase", r.phase},
                             {"batch", r.batch},
                             {"ours_tok_s", r.tok_s},
                             {"ms", r.ms},
                             {"peak_gpu_mib", r.peak_mib},
                             {"hit_rate", r.hit_rate},
                             {"pcie_bytes_per_token", r.pcie_bytes_per_token},
                             {"misses_per_token", r.misses_per_token},
                             {"predict_accuracy", r.accuracy},
                             {"islands", r.islands},
                             {"policy", o.policy},
                             {"transformers_tok_s", nullptr}});
      std::ofstream(o.json) << j.dump(2) << "\n";
      return ok ? 0 : 1;
    }
    j["date"] = date;
    j["gpu"] = prop.name;
    j["commit"] = o.commit;
    j["settings"] = {{"context", o.context},         {"steps", o.steps},  {"prompt", o.prompt},
                     {"expert_group", 64},           {"experts", "int4"}, {"other_weights", "bf16"},
                     {"sampling", "greedy (on GPU)"}};
    j["rows"] = nlohmann::json::array();
    for (const Row& r : rows) {
      nlohmann::json x = {{"shape", r.shape},           {"mode", "resident"},    {"phase", r.phase},
                          {"batch", r.batch},           {"ours_tok_s", r.tok_s}, {"ms", r.ms},
                          {"peak_gpu_mib", r.peak_mib}, {"hit_rate", 1.0}};
      x["transformers_tok_s"] =
          r.transformers > 0 ? nlohmann::json(r.transformers) : nlohmann::json(nullptr);
      if (r.phase == "decode") x["weight_gb_s"] = r.gbps;
      j["rows"].push_back(x);
    }
    j["kernels"] = kernels;
    std::ofstream(o.json) << j.dump(2) << "\n";
  }
  return ok ? 0 : 1;
}
