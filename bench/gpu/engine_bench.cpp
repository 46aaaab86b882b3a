// moe-bench-engine: the worker's own CudaEngine (the code behind
// `moe-worker --backend cuda`) at two real MoE shapes, with seeded random
// weights made in host memory (bench/gpu/synthetic_model.h): decode at batch
// 1 and 8 after a 128-token prompt, and a 512-token prefill, all experts
// resident or under a --vram-budget. Steps go through CudaEngine::step
// exactly as the worker runs them (host inputs, sampling, outputs back).
// Routing: "router" is what the random router weights pick (concentrated:
// a few experts take most tokens); "uniform" draws every token's experts
// uniformly (CudaEngineOptions::uniform_routing_seed), the load the offload
// targets are stated for; "replay" walks the routing a real model chose on
// real text (bench/e2e/traces: Qwen3-30B-A3B's own for qwen3, a recording
// mapped onto qwen15; replay:FILE another), each sequence from an offset of
// its own. GPU memory is the process's, from nvidia-smi.
//   moe-bench-engine [--shape qwen15|qwen3|dsv2lite|all] [--vram-budget 12GiB[,8GiB]]
//                    [--routing router|uniform|replay[:FILE][,...]] [--host-experts auto|on|off]
//                    [--misses stream|copy] [--threads N] [--skip-resident]
//                    [--budget-batches 1[,8...]] (decode batches under a budget; default 1)
//                    [--admit-per-pass N] (streamed experts copied into islands a pass at most)
//                    [--stream-ahead on|off] (layer-ahead staging of guessed experts in streamed
//                    passes of one token) [--guess-recall P] (with replayed routing: guesses from the
//                    trace's next layer, each kept with chance P, instead of the seeded router's)
//                    [--attention-split-keys N] (decode attention: a query of 2N+ keys split over
//                    blocks of N+ keys each, N a multiple of 32; default the engine's)
//                    [--fused-decode on|off] (resident decode of one token in one launch; default off)
//                    [--fused-stamps] (the fused pass's time by phase, block 0's clock)
//                    [--steps N] [--prompt N] [--policy P] [--prefetch on|off]
//                    [--dense-weights auto|bf16|int8|int4]
//                    [--budget-dense-weights auto|bf16|int8|int4] [--json PATH]
//                    [--model DIR|FILE] (a checkpoint folder or packed file instead of --shape)
//                    [--profile-steps N] (N decode steps of each batch and one prefill step
//                    between profiler start and stop, each led by a marker kernel whose grid
//                    size numbers the phase: ncu --profile-from-start off, then
//                    bench/gpu/kernel_budget.py)
// --budget-dense-weights: the dtype under a budget (default: --dense-weights).
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <optional>
#include <type_traits>
#include <unistd.h>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "bench/gpu/profile_marker.h"
#include "bench/gpu/synthetic_model.h"
#include "cuda_engine/cuda_engine.h"

namespace {

using namespace moe;
using Clock = std::chrono::steady_clock;

struct Options {
  std::string shape = "all";
  std::string model;  // a checkpoint folder or packed file: its weights instead of a shape's
  std::vector<double> budgets_gib;  // empty: resident only
  int steps = 128, context = 128, prompt = 512;
  EvictionKind policy = EvictionKind::ours;
  bool prefetch = true;
  DenseWeights dense_weights = DenseWeights::automatic;
  std::optional<DenseWeights> budget_dense_weights;  // unset: dense_weights
  int fuse_max_tokens = 4;
  std::vector<std::string> routings = {"router"};
  HostShareMode host_experts = HostShareMode::automatic;
  MissMode misses = MissMode::stream;
  int threads = 0;
  bool resident = true;  // --skip-resident: the budgets' rows only
  std::vector<int> budget_batches = {1};  // decode batches under a budget
  int admit_per_pass = 0;                 // 0: the engine's default
  bool stream_ahead = false;              // --stream-ahead on: layer-ahead staging in streamed passes
  double guess_recall = -1;               // --guess-recall P: replayed routing's guesses (< 0: the router's)
  int split_keys = 0;                     // --attention-split-keys N (0: the engine's default)
  bool fused_decode = false;              // --fused-decode on: resident decode of one token in one launch
  bool fused_stamps = false;              // --fused-stamps: where the fused pass's time goes, by phase
  int profile_steps = 0;                  // decode steps a batch under the profiler (0: none)
  std::string json;
  // --omit: sets of kernels left out, one engine each ({"", 0}: none).
  std::vector<std::pair<std::string, uint32_t>> omit_sets = {{"", 0}};
};

// The profiled phases so far; each is announced with its number and label.
int profile_phase(const std::string& label) {
  static int n = 0;
  std::printf("profiled phase %d: %s\n", ++n, label.c_str());
  std::fflush(stdout);
  return n;
}

// The GPU memory this process holds, as nvidia-smi reports it (context
// included); the device's used memory when nvidia-smi cannot say.
double used_mib() {
  const std::string cmd = "nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader,nounits 2>/dev/null";
  if (FILE* f = popen(cmd.c_str(), "r")) {
    char line[256];
    double mib = -1;
    while (std::fgets(line, sizeof line, f)) {
      long pid = 0;
      double m = 0;
      if (std::sscanf(line, "%ld, %lf", &pid, &m) == 2 && pid == long(getpid())) mib = m;
    }
    pclose(f);
    if (mib >= 0) return mib;
  }
  size_t f = 0, t = 0;
  cudaMemGetInfo(&f, &t);
  return double(t - f) / (1 << 20);
}

std::vector<std::string> split_list(const std::string& v, char sep = ',') {
  std::vector<std::string> out;
  size_t p = 0;
  while (p <= v.size()) {
    const size_t c = v.find(sep, p);
    out.push_back(v.substr(p, c == std::string::npos ? std::string::npos : c - p));
    if (c == std::string::npos) break;
    p = c + 1;
  }
  return out;
}

std::vector<int32_t> tokens(int n, uint64_t seed, int vocab) {
  std::vector<int32_t> v(static_cast<size_t>(n));
  for (auto& t : v) {
    seed = seed * 6364136223846793005ull + 1442695040888963407ull;
    t = int32_t((seed >> 33) % uint64_t(vocab));
  }
  return v;
}

SeqInput greedy(uint64_t id, std::vector<int32_t> toks, int start) {
  SeqInput in;
  in.seq_id = id;
  in.tokens = std::move(toks);
  in.start_pos = start;
  in.sampling.temperature = 0;
  return in;
}

struct Row {
  std::string shape, mode, phase, dense = "bf16", routing = "router";
  std::string omit;  // --omit: the kernels left out (a diagnosis, not a result)
  std::string fused;  // decode b1: the engine's fused decode state ("on", or why off)
  int batch = 0;
  double tok_s = 0, peak_mib = 0, hit_rate = 1, pcie_mb_per_token = 0, host_experts_per_token = 0;
  double staged_per_token = 0;  // experts copied a layer ahead (--stream-ahead on)
  // The host's share (streamed passes): per token, the host's time on its
  // layers and the GPU's time waiting for them; waits over 50 µs a token;
  // the longest wait over the engine's life (warm-up and earlier rows too).
  double share_host_us = 0, share_wait_us = 0, share_max_wait_us = 0, share_stalls = 0;
};

// Hit rate and PCIe bytes per token between two snapshots of the counters.
void expert_figures(Row& row, const CudaExpertStats& s0, const CudaExpertStats& s1, double tokens) {
  // A miss the host computed counts as a miss: it was not in an island
  // (streamed passes count the host's share among the map's misses already).
  const double hits = double(s1.residency.hits - s0.residency.hits);
  const double copy_split = double(s1.host_experts_served - s0.host_experts_served);
  const double host = copy_split + double(s1.host_share_served - s0.host_share_served);
  const double miss = double(s1.residency.misses - s0.residency.misses) + copy_split;
  row.hit_rate = s1.all_resident ? 1.0 : (hits + miss > 0 ? hits / (hits + miss) : 0);
  row.host_experts_per_token = host / tokens;
  row.staged_per_token = double(s1.experts_staged - s0.experts_staged) / tokens;
  const ShareTimes &t0 = s0.share_times, &t1 = s1.share_times;
  row.share_host_us = (t1.host_us - t0.host_us) / tokens;
  row.share_wait_us = (t1.gpu_wait_us - t0.gpu_wait_us) / tokens;
  row.share_max_wait_us = t1.max_wait_us;
  row.share_stalls = double(t1.stalls - t0.stalls) / tokens;
  // Copies into islands and misses the kernels read over the link alike.
  row.pcie_mb_per_token = double(s1.residency.bytes_copied - s0.residency.bytes_copied +
                                 s1.bytes_streamed - s0.bytes_streamed) /
                          1e6 / tokens;
}

// Decode: `batch` sequences after a `context`-token prompt each; the median
// step time of `steps` steps (after 8 warm-up steps).
// The recorded routing of a real model for a benchmark shape
// (bench/e2e/traces/README.md), relative to the repository root.
std::string replay_trace_of(const std::string& shape) {
  if (shape == "Qwen3-30B-A3B") return "bench/e2e/traces/qwen3-30b-a3b.safetensors";
  if (shape == "Qwen1.5-MoE-A2.7B") return "bench/e2e/traces/qwen1.5-moe-a2.7b.safetensors";
  return "";
}

Result<Row> decode(CudaEngine& e, int batch, const Options& o, const std::string& label) {
  const int V = e.desc().vocab_size;
  std::vector<SeqInput> step;
  for (int b = 0; b < batch; ++b) step.push_back(greedy(uint64_t(b + 1), tokens(o.context, 17 + b, V), 0));
  auto r = e.step(step);
  if (!r) return make_error(r.error());
  std::vector<int> pos(size_t(batch), o.context);
  std::vector<double> ms;
  CudaExpertStats s0{};
  for (int i = 0; i < o.steps + 8; ++i) {
    std::vector<SeqInput> next;
    for (int b = 0; b < batch; ++b) next.push_back(greedy(uint64_t(b + 1), {(*r)[size_t(b)].token}, pos[size_t(b)]++));
    if (i == 8) s0 = e.expert_stats();
    // The profiled steps come after the timed ones (a profiler slows them).
    if (o.profile_steps > 0 && i == o.steps + 8 - o.profile_steps)
      bench::profile_begin(profile_phase(label + " decode b" + std::to_string(batch) + ", " +
                                         std::to_string(o.profile_steps) + " steps"));
    const auto t0 = Clock::now();
    r = e.step(next);
    if (!r) return make_error(r.error());
    if (i >= 8 && i < o.steps + 8 - o.profile_steps)
      ms.push_back(std::chrono::duration<double, std::milli>(Clock::now() - t0).count());
  }
  if (o.profile_steps > 0) bench::profile_end();
  const CudaExpertStats s1 = e.expert_stats();
  for (int b = 0; b < batch; ++b) e.release(uint64_t(b + 1));
  std::sort(ms.begin(), ms.end());
  Row row;
  row.phase = "decode";
  row.batch = batch;
  row.tok_s = batch * 1000.0 / ms[ms.size() / 2];
  expert_figures(row, s0, s1, double(o.steps) * batch);
  return row;
}

// Prefill: one prompt of o.prompt tokens, its next token sampled; median of 5.
Result<Row> prefill(CudaEngine& e, const Options& o, const std::string& label) {
  const int V = e.desc().vocab_size;
  std::vector<double> ms;
  const CudaExpertStats s0 = e.expert_stats();
  for (int i = 0; i < 6; ++i) {
    std::vector<SeqInput> step = {greedy(100, tokens(o.prompt, 1000 + i, V), 0)};
    const bool profiled = o.profile_steps > 0 && i == 5;  // the last, after the timed ones
    if (profiled) bench::profile_begin(profile_phase(label + " prefill " + std::to_string(o.prompt) + ", 1 step"));
    const auto t0 = Clock::now();
    auto r = e.step(step);
    if (profiled) bench::profile_end();
    if (!r) return make_error(r.error());
    if (i > 0 && !profiled) ms.push_back(std::chrono::duration<double, std::milli>(Clock::now() - t0).count());
    e.release(100);
  }
  const CudaExpertStats s1 = e.expert_stats();
  std::sort(ms.begin(), ms.end());
  Row row;
  row.phase = "prefill";
  row.batch = o.prompt;
  row.tok_s = o.prompt * 1000.0 / ms[ms.size() / 2];
  expert_figures(row, s0, s1, 6.0 * o.prompt);
  return row;
}

int usage() {
  std::fprintf(stderr,
               "usage: moe-bench-engine [--shape qwen15|qwen3|dsv2lite|all] [--vram-budget 12GiB[,8GiB...]] [--steps N]\n"
               "                        [--context N] [--prompt N] [--policy lru|lfu|ours] [--prefetch on|off]\n"
               "                        [--dense-weights auto|bf16|int8|int4] [--fuse-max-tokens N]\n"
               "                        [--budget-dense-weights auto|bf16|int8|int4]\n"
               "                        [--routing router|uniform|replay[:FILE][,...]] [--host-experts auto|on|off]\n"
               "                        [--misses stream|copy] [--threads N] [--skip-resident]\n"
               "                        [--budget-batches 1[,8...]] [--admit-per-pass N]\n"
               "                        [--stream-ahead on|off] [--guess-recall P] [--attention-split-keys N]\n"
               "                        [--fused-decode on|off] [--fused-stamps]\n"
               "                        [--json PATH] [--profile-steps N] [--omit KERNEL[,KERNEL...][;...]]\n");
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto val = [&]() -> std::string { return i + 1 < argc ? argv[++i] : ""; };
    // An enum option from its spelling; anything else ends with the usage.
    bool bad = false;
    auto choose = [&](auto& field) {
      auto c = parse_option<std::remove_reference_t<decltype(field)>>(a, val());
      if (c) field = *c;
      else std::fprintf(stderr, "moe-bench-engine: %s\n", c.error().c_str());
      bad = bad || !c.ok();
    };
    // An on|off option; anything else ends with the usage.
    auto on_off = [&](bool& field) {
      const std::string v = val();
      if (v == "on" || v == "off") field = v == "on";
      else std::fprintf(stderr, "moe-bench-engine: %s takes on or off\n", a.c_str());
      bad = bad || (v != "on" && v != "off");
    };
    if (a == "--shape") o.shape = val();
    else if (a == "--steps") o.steps = std::atoi(val().c_str());
    else if (a == "--context") o.context = std::atoi(val().c_str());
    else if (a == "--prompt") o.prompt = std::atoi(val().c_str());
    else if (a == "--policy") choose(o.policy);
    else if (a == "--prefetch") o.prefetch = val() == "on";
    else if (a == "--dense-weights") choose(o.dense_weights);
    else if (a == "--budget-dense-weights") choose(o.budget_dense_weights.emplace());
    else if (a == "--fuse-max-tokens") o.fuse_max_tokens = std::atoi(val().c_str());
    else if (a == "--json") o.json = val();
    else if (a == "--omit") {
      o.omit_sets.clear();
      for (std::string set : split_list(val(), ';')) {
        if (set == "none") set.clear();
        auto bits = parse_omit(set);
        if (bits) o.omit_sets.emplace_back(set, *bits);
        else std::fprintf(stderr, "moe-bench-engine: %s\n", bits.error().c_str());
        bad = bad || !bits.ok();
      }
    }
    else if (a == "--host-experts") choose(o.host_experts);
    else if (a == "--misses") choose(o.misses);
    else if (a == "--threads") o.threads = std::atoi(val().c_str());
    else if (a == "--skip-resident") o.resident = false;
    else if (a == "--admit-per-pass") o.admit_per_pass = std::atoi(val().c_str());
    else if (a == "--stream-ahead") on_off(o.stream_ahead);
    else if (a == "--fused-decode") on_off(o.fused_decode);
    else if (a == "--fused-stamps") {
      o.fused_stamps = true;
    } else if (a == "--attention-split-keys") {
      o.split_keys = std::atoi(val().c_str());
      if (o.split_keys < 32 || o.split_keys % 32 != 0) {
        std::fprintf(stderr, "moe-bench-engine: --attention-split-keys takes a positive multiple of 32\n");
        return usage();
      }
    } else if (a == "--guess-recall") {
      const std::string v = val();
      char* end = nullptr;
      o.guess_recall = std::strtod(v.c_str(), &end);
      if (v.empty() || *end != '\0' || o.guess_recall < 0 || o.guess_recall > 1) {
        std::fprintf(stderr, "moe-bench-engine: --guess-recall takes 0 to 1\n");
        return usage();
      }
    }
    else if (a == "--model") o.model = val();
    else if (a == "--profile-steps") o.profile_steps = std::atoi(val().c_str());
    else if (a == "--budget-batches") {
      o.budget_batches.clear();
      for (const auto& b : split_list(val())) o.budget_batches.push_back(std::atoi(b.c_str()));
      if (o.budget_batches.empty() ||
          std::any_of(o.budget_batches.begin(), o.budget_batches.end(), [](int b) { return b < 1 || b > 64; })) {
        std::fprintf(stderr, "moe-bench-engine: --budget-batches takes batch sizes from 1 to 64\n");
        return usage();
      }
    }
    else if (a == "--routing") {
      o.routings = split_list(val());
      for (const auto& r : o.routings)
        if (r != "router" && r != "uniform" && r != "replay" && r.rfind("replay:", 0) != 0) {
          std::fprintf(stderr, "moe-bench-engine: --routing takes router, uniform, replay or replay:FILE, not '%s'\n",
                       r.c_str());
          return usage();
        }
    } else if (a == "--vram-budget") {
      for (const auto& b : split_list(val())) o.budgets_gib.push_back(std::atof(b.c_str()));
    } else if (a == "--help" || a == "-h") {
      usage();
      return 0;
    } else {
      std::fprintf(stderr, "moe-bench-engine: unknown option %s\n", a.c_str());
      return usage();
    }
    if (bad) return usage();
  }
  if (o.profile_steps < 0 || o.profile_steps >= o.steps) {
    std::fprintf(stderr, "moe-bench-engine: --profile-steps takes 0 to --steps - 1 (%d)\n", o.steps - 1);
    return usage();
  }
  auto dev = cuda_device_summary();
  if (!dev) {
    std::printf("SKIPPED: no CUDA device (%s)\n", dev.error().c_str());
    return 0;
  }
  std::printf("moe-bench-engine on %s\n", dev->c_str());
  std::vector<bench::ModelShape> shapes;
  if (!o.model.empty()) {
    bench::ModelShape from_files{};
    from_files.name = o.model;
    shapes.push_back(from_files);
  } else {
    if (o.shape == "qwen15" || o.shape == "all") shapes.push_back(bench::qwen15_moe_a27b());
    if (o.shape == "qwen3" || o.shape == "all") shapes.push_back(bench::qwen3_30b_a3b());
    if (o.shape == "dsv2lite") shapes.push_back(bench::deepseek_v2_lite());  // not in "all": the two shapes' runs stay as they were
  }
  std::vector<Row> rows;
  for (const auto& s : shapes) {
    const auto t0 = Clock::now();
    // A checkpoint on disk, or weights made in memory.
    Result<std::unique_ptr<bench::SyntheticModel>> model = make_error("no model");
    if (!o.model.empty()) {
      auto files = ModelFiles::open(o.model);
      if (!files) {
        std::fprintf(stderr, "moe-bench-engine: %s\n", files.error().c_str());
        return 1;
      }
      auto m = std::make_unique<bench::SyntheticModel>();
      m->files = std::move(*files);
      model = std::move(m);
    } else {
      model = bench::make_synthetic_model(s, 42);
    }
    if (!model) {
      std::fprintf(stderr, "moe-bench-engine: %s\n", model.error().c_str());
      return 1;
    }
    std::printf("%s: weights %s in %.1f s (experts %.2f GiB in host memory)\n", s.name.c_str(),
                o.model.empty() ? "made" : "opened", std::chrono::duration<double>(Clock::now() - t0).count(),
                (*model)->expert_bytes / double(1 << 30));
    std::vector<double> modes;
    if (o.resident || o.budgets_gib.empty()) modes.push_back(0);
    for (double b : o.budgets_gib) modes.push_back(b);
    for (double gib : modes)
      for (const auto& [omit_name, omit_bits] : o.omit_sets)
      for (const std::string& routing : o.routings) {
        CudaEngineOptions eo;
        eo.vram_budget = size_t(gib * double(1ull << 30));
        // A fixed split, as the earlier figures had: no KV taking islands mid-run.
        eo.kv_trade = false;
        // KV: what the runs need and no more under a budget (the rest of it
        // goes to islands): the largest batch there, 8 resident, each sequence
        // context + warm-up + steps + 1 tokens, or one prompt; at least 1,024
        // tokens under a budget, 4,096 resident (the earlier fixed pools).
        const int batch = gib == 0 ? 8 : *std::max_element(o.budget_batches.begin(), o.budget_batches.end());
        const int seq_blocks = (o.context + o.steps + 9 + 15) / 16, prompt_blocks = (o.prompt + 1 + 15) / 16;
        eo.kv_blocks = std::max({batch * seq_blocks, prompt_blocks, gib == 0 ? 256 : 64});
        eo.policy = o.policy;
        eo.prefetch = o.prefetch;
        eo.dense_weights = gib == 0 || !o.budget_dense_weights ? o.dense_weights : *o.budget_dense_weights;
        eo.fuse_max_tokens = o.fuse_max_tokens;
        eo.uniform_routing_seed = routing == "uniform" ? 0x5eed : 0;
        if (routing.rfind("replay", 0) == 0) {
          eo.routing_trace = routing.size() > 7 ? routing.substr(7) : replay_trace_of(s.name);
          if (eo.routing_trace.empty()) {
            std::fprintf(stderr, "moe-bench-engine: no recorded routing for shape %s: --routing replay:FILE\n",
                         s.name.c_str());
            return 1;
          }
        }
        eo.bench_omit = omit_bits;
        eo.host_experts = o.host_experts;
        eo.misses = o.misses;
        eo.host_threads = o.threads;
        if (o.admit_per_pass > 0) eo.stream_admit_per_pass = o.admit_per_pass;
        eo.stream_ahead = o.stream_ahead;
        if (o.split_keys > 0) eo.attention_split_keys = o.split_keys;
        eo.fused_decode = o.fused_decode;
        eo.bench_fused_stamps = o.fused_stamps;
        eo.bench_guess_recall = o.guess_recall;
        if (o.guess_recall >= 0 && (routing.rfind("replay", 0) != 0 || !o.stream_ahead)) {
          std::fprintf(stderr, "moe-bench-engine: --guess-recall draws guesses from a replayed trace for "
                               "--stream-ahead on: it needs --routing replay[:FILE] (routing %s)\n",
                       routing.c_str());
          return 1;
        }
        const auto t1 = Clock::now();
        auto e = CudaEngine::create((*model)->files, eo);
        if (!e) {
          std::fprintf(stderr, "moe-bench-engine: %s\n", e.error().c_str());
          return 1;
        }
        const std::string mode = gib == 0 ? std::string("resident") : "budget-" + std::to_string(int(gib)) + "GiB";
        const std::string dense = (*e)->expert_stats().dense_weights +
                                  ((*e)->expert_stats().host_embedding ? ", embedding on host" : "");
        std::printf("  %s, %s routing: engine ready in %.1f s, %lld islands, dense weights %s, fused decode %s\n",
                    mode.c_str(), routing.c_str(), std::chrono::duration<double>(Clock::now() - t1).count(),
                    (long long)(*e)->plan().n_islands, dense.c_str(), (*e)->expert_stats().fused_decode.c_str());
        const std::string fused_state = (*e)->expert_stats().fused_decode;
        std::fflush(stdout);
        auto keep = [&](Row r) {
          r.shape = s.name;
          r.mode = mode;
          r.dense = dense;
          r.routing = routing;
          r.omit = omit_name;
          r.fused = r.phase == "decode" && r.batch == 1 ? fused_state : "";
          r.peak_mib = used_mib();
          if (!r.omit.empty()) std::printf("    without %s:", r.omit.c_str());
          std::printf("    %s b%d: %.1f tok/s, hit %.3f, %.1f MB/token over PCIe, %.2f experts/token on the host, "
                      "%.0f MiB\n",
                      r.phase.c_str(), r.batch, r.tok_s, r.hit_rate, r.pcie_mb_per_token, r.host_experts_per_token,
                      r.peak_mib);
          if (r.phase == "decode" && r.batch == 1 && o.fused_stamps) {
            const std::vector<double> us = (*e)->expert_stats().fused_phase_us;
            const char* names[] = {"q|k|v", "attention", "o", "router", "gate|up", "down"};
            if (us.size() == 12) {
              std::printf("      fused pass, block 0, us a layer (work + barrier):");
              for (int p = 0; p < 6; ++p) std::printf(" %s %.1f + %.1f;", names[p], us[size_t(2 * p)], us[size_t(2 * p + 1)]);
              std::printf("\n");
            }
          }
          if (r.staged_per_token > 0)
            std::printf("      staged a layer ahead: %.2f experts a token\n", r.staged_per_token);
          if (r.share_host_us > 0)
            std::printf("      host's share: host %.0f us a token on its layers, GPU waited %.0f us a token for it "
                        "(%.2f waits over 50 us a token; longest in the engine's life %.0f us)\n",
                        r.share_host_us, r.share_wait_us, r.share_stalls, r.share_max_wait_us);
          std::fflush(stdout);
          rows.push_back(r);
        };
        std::vector<int> batches = gib == 0 ? std::vector<int>{1, 8} : o.budget_batches;
        const std::string label = s.name + " " + mode + " " + routing;  // a profiled phase's
        for (int b : batches) {
          auto r = decode(**e, b, o, label);
          if (!r) {
            std::fprintf(stderr, "moe-bench-engine: %s\n", r.error().c_str());
            return 1;
          }
          keep(*r);
        }
        if (omit_bits) continue;  // a diagnosis of decode steps
        auto p = prefill(**e, o, label);
        if (!p) {
          std::fprintf(stderr, "moe-bench-engine: %s\n", p.error().c_str());
          return 1;
        }
        keep(*p);
      }
  }
  std::printf("\n| shape | mode | routing | dense weights | phase | batch | tok/s | hit rate | PCIe MB/token | GPU MiB |\n"
              "|---|---|---|---|---|---|---|---|---|---|\n");
  for (const Row& r : rows)
    std::printf("| %s | %s | %s | %s | %s%s%s | %d | %.0f | %.3f | %.1f | %.0f |\n", r.shape.c_str(), r.mode.c_str(),
                r.routing.c_str(), r.dense.c_str(), r.phase.c_str(), r.omit.empty() ? "" : " without ", r.omit.c_str(),
                r.batch, r.tok_s, r.hit_rate, r.pcie_mb_per_token, r.peak_mib);
  if (!o.json.empty()) {
    nlohmann::json j = nlohmann::json::array();
    for (const Row& r : rows) {
      j.push_back({{"shape", r.shape}, {"mode", r.mode}, {"routing", r.routing}, {"dense_weights", r.dense},
                   {"phase", r.phase}, {"batch", r.batch}, {"ours_tok_s", r.tok_s}, {"hit_rate", r.hit_rate},
                   {"pcie_mb_per_token", r.pcie_mb_per_token}, {"host_experts_per_token", r.host_experts_per_token}, {"staged_per_token", r.staged_per_token},
                   {"peak_gpu_mib", r.peak_mib}});
      if (!r.omit.empty()) j.back()["omit"] = r.omit;
      if (!r.fused.empty()) j.back()["fused_decode"] = r.fused;
    }
    std::ofstream(o.json) << j.dump(1) << "\n";
  }
  return 0;
}
