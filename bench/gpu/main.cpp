// moe-bench-gpu: decode and prefill speed of two real MoE shapes with random
// weights, all experts resident on the GPU (INT4, group 64; the rest bf16).
//   moe-bench-gpu [--shape qwen15|qwen3|all] [--steps N] [--context N]
//                 [--prompt N] [--json PATH] [--no-kernels]
// Decode: one CUDA graph per step, replayed `steps` times from `context`
// tokens of context; the step's greedy token feeds the next step on the GPU.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "bench/gpu/bench_model.h"

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
};

struct Row {
  std::string shape, phase;
  int batch = 0;
  double tok_s = 0, ms = 0, gbps = 0;
  double peak_mib = 0;
  double transformers = -1;  // -1: not measured
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

#define MAIN_TRY(expr)                                        \
  do {                                                        \
    Status st_ = (expr);                                      \
    if (!st_.ok()) {                                          \
      std::fprintf(stderr, "error: %s\n", st_.error().c_str()); \
      return false;                                           \
    }                                                         \
  } while (0)

#define CU_TRY(expr)                                                                  \
  do {                                                                                \
    cudaError_t e_ = (expr);                                                          \
    if (e_ != cudaSuccess) {                                                          \
      std::fprintf(stderr, "error: %s at %s:%d\n", cudaGetErrorString(e_), __FILE__, __LINE__); \
      return false;                                                                   \
    }                                                                                 \
  } while (0)

bool bench_shape(const ModelShape& s, const Options& o, std::vector<Row>& rows, nlohmann::json& kernels) {
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
    std::printf("   decode batch %d: %.3f ms/step, %.1f tok/s (%.0f GB/s of weights)\n", batch, step_ms, row.tok_s,
                row.gbps);
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
      kernels.push_back({{"shape", s.name}, {"kernel", k.name}, {"us", k.us}, {"gb_s", gbps}, {"tflop_s", tf}});
    }
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  m.reset();
  cudaStreamDestroy(st);
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> std::string { return i + 1 < argc ? argv[++i] : ""; };
    if (a == "--shape") o.shape = next();
    else if (a == "--steps") o.steps = std::stoi(next());
    else if (a == "--context") o.context = std::stoi(next());
    else if (a == "--prompt") o.prompt = std::stoi(next());
    else if (a == "--json") o.json = next();
    else if (a == "--commit") o.commit = next();
    else if (a == "--fuse-max-batch") o.fuse_max_batch = std::stoi(next());
    else if (a == "--no-kernels") o.kernels = false;
    else {
      std::fprintf(stderr, "usage: moe-bench-gpu [--shape qwen15|qwen3|all] [--steps N] [--context N] "
                           "[--prompt N] [--json PATH] [--commit HASH] [--fuse-max-batch N] [--no-kernels]\n");
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
  std::vector<ModelShape> shapes;
  if (o.shape == "qwen15" || o.shape == "all") shapes.push_back(moe::bench::qwen15_moe_a27b());
  if (o.shape == "qwen3" || o.shape == "all") shapes.push_back(moe::bench::qwen3_30b_a3b());
  std::vector<Row> rows;
  nlohmann::json kernels = nlohmann::json::array();
  bool ok = true;
  for (const auto& s : shapes) ok = bench_shape(s, o, rows, kernels) && ok;

  std::printf("\n%s, decode from %d tokens of context (%d steps, CUDA graph), prefill %d tokens\n", prop.name,
              o.context, o.steps, o.prompt);
  std::printf("%-20s %-8s %6s %10s %12s %14s %10s\n", "shape", "phase", "batch", "ms", "ours tok/s",
              "transformers", "peak MiB");
  for (const Row& r : rows) {
    char tf[32] = "-";
    if (r.transformers > 0) std::snprintf(tf, sizeof tf, "%.1f", r.transformers);
    std::printf("%-20s %-8s %6d %10.3f %12.1f %14s %10.0f\n", r.shape.c_str(), r.phase.c_str(), r.batch, r.ms,
                r.tok_s, tf, r.peak_mib);
  }
  if (!o.json.empty()) {
    char date[32];
    const std::time_t now = std::time(nullptr);
    std::strftime(date, sizeof date, "%Y-%m-%d", std::gmtime(&now));
    nlohmann::json j;
    j["date"] = date;
    j["gpu"] = prop.name;
    j["commit"] = o.commit;
    j["settings"] = {{"context", o.context}, {"steps", o.steps}, {"prompt", o.prompt}, {"expert_group", 64},
                     {"experts", "int4"}, {"other_weights", "bf16"}, {"sampling", "greedy (on GPU)"}};
    j["rows"] = nlohmann::json::array();
    for (const Row& r : rows) {
      nlohmann::json x = {{"shape", r.shape},          {"mode", "resident"},
                          {"phase", r.phase},          {"batch", r.batch},
                          {"ours_tok_s", r.tok_s},     {"ms", r.ms},
                          {"peak_gpu_mib", r.peak_mib}, {"hit_rate", 1.0}};
      x["transformers_tok_s"] = r.transformers > 0 ? nlohmann::json(r.transformers) : nlohmann::json(nullptr);
      if (r.phase == "decode") x["weight_gb_s"] = r.gbps;
      j["rows"].push_back(x);
    }
    j["kernels"] = kernels;
    std::ofstream(o.json) << j.dump(2) << "\n";
  }
  return ok ? 0 : 1;
}
