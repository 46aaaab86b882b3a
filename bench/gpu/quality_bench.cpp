// moe-bench-quality: what the CUDA worker's quantised non-expert weights
// cost. For each --dense-weights (bf16, int8, int4; experts INT4 in every
// case, as the worker runs them), all experts resident, the model reads the
// token ids of --ids teacher-forced in windows of --ctx (as `moe
// perplexity` cuts them), every window a sequence of one batch, one token a
// step: the mean negative log-likelihood of each next id (SeqInput's
// score_token), and per MoE layer how many of each token's top-k experts the
// dtype picks as bf16 does (routing agreement), and how often its greedy
// next token is bf16's.
//   moe-bench-quality --model DIR|FILE --ids FILE [--ctx 512] [--json OUT]
// --ids: the output of `moe tokenize` (a JSON list of ids).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <iterator>
#include <map>
#include <numeric>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "cuda_engine/cuda_engine.h"

namespace {

using namespace moe;

struct Run {
  double nll = 0;
  int64_t tokens = 0;
  std::vector<int32_t> greedy;                // per scored position
  std::vector<std::vector<int32_t>> experts;  // per scored position: [layer * K + k] expert ids
};

// `variant`: a dense dtype, "+router" for the router's rows kept in bf16.
Result<Run> run(std::shared_ptr<ModelFiles> files, const std::string& variant, const std::vector<int32_t>& ids,
                int ctx) {
  const int windows = int((ids.size() - 2) / size_t(ctx)) + 1;
  CudaEngineOptions eo;
  const size_t plus = variant.find('+');
  eo.dense_weights = parse_choice<DenseWeights>(variant.substr(0, plus)).value();
  eo.router_bf16 = plus != std::string::npos;
  eo.kv_blocks = windows * ((ctx + 1 + 15) / 16) + 16;
  eo.max_context = ctx + 16;
  auto e = CudaEngine::create(files, eo);
  if (!e) return make_error(e.error());
  CudaEngine& eng = **e;
  const int Lm = eng.desc().n_moe_layers(), E = eng.desc().moe.n_experts, K = eng.desc().moe.top_k;
  Run r;
  for (int t = 0; t < ctx; ++t) {
    std::vector<SeqInput> step;
    for (int w = 0; w < windows; ++w) {
      const size_t at = size_t(w) * ctx + size_t(t);
      if (at + 1 >= ids.size()) continue;
      SeqInput in;
      in.seq_id = uint64_t(w + 1);
      in.tokens = {ids[at]};
      in.start_pos = t;
      in.sample = true;
      in.sampling.temperature = 0;
      in.score_token = ids[at + 1];
      step.push_back(std::move(in));
    }
    if (step.empty()) break;
    auto out = eng.step(step);
    if (!out) return make_error(out.error());
    for (const SeqOutput& o : *out) {
      r.nll -= o.score_logprob;
      ++r.tokens;
      r.greedy.push_back(o.token);
      std::vector<int32_t> chosen;
      for (int l = 0; l < Lm; ++l) {
        int got = 0;
        for (int x = 0; x < E; ++x)
          if (o.expert_counts[size_t(l) * E + x] > 0 && got < K) {
            chosen.push_back(x);
            ++got;
          }
        for (; got < K; ++got) chosen.push_back(-1);
      }
      r.experts.push_back(std::move(chosen));
    }
  }
  r.nll /= double(std::max<int64_t>(r.tokens, 1));
  return r;
}

}  // namespace

int main(int argc, char** argv) {
  std::string model, ids_file, json_out;
  int ctx = 512;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto val = [&]() -> std::string { return i + 1 < argc ? argv[++i] : ""; };
    if (a == "--model") model = val();
    else if (a == "--ids") ids_file = val();
    else if (a == "--ctx") ctx = std::atoi(val().c_str());
    else if (a == "--json") json_out = val();
    else {
      std::fprintf(stderr, "usage: moe-bench-quality --model DIR|FILE --ids FILE [--ctx 512] [--json OUT]\n");
      return 2;
    }
  }
  if (model.empty() || ids_file.empty() || ctx < 2) {
    std::fprintf(stderr, "usage: moe-bench-quality --model DIR|FILE --ids FILE [--ctx 512] [--json OUT]\n");
    return 2;
  }
  auto dev = cuda_device_summary();
  if (!dev) {
    std::printf("SKIPPED: no CUDA device (%s)\n", dev.error().c_str());
    return 0;
  }
  std::ifstream in(ids_file);
  const nlohmann::json j = nlohmann::json::parse(in, nullptr, false);
  if (!j.is_array() || j.size() < 3) {
    std::fprintf(stderr, "moe-bench-quality: %s holds no list of ids\n", ids_file.c_str());
    return 1;
  }
  const std::vector<int32_t> ids = j.get<std::vector<int32_t>>();
  auto files = ModelFiles::open(model);
  if (!files) {
    std::fprintf(stderr, "moe-bench-quality: %s\n", files.error().c_str());
    return 1;
  }
  const int Lm = (*files)->desc().n_moe_layers(), K = (*files)->desc().moe.top_k;
  std::printf("moe-bench-quality on %s: %s, %zu ids, windows of %d\n", dev->c_str(), model.c_str(), ids.size(), ctx);
  std::map<std::string, Run> runs;
  const std::vector<std::string> variants = {"bf16", "int8", "int8+router-bf16", "int4", "int4+router-bf16"};
  for (const std::string& dt : variants) {
    auto r = run(*files, dt, ids, ctx);
    if (!r) {
      std::fprintf(stderr, "moe-bench-quality: %s: %s\n", dt.c_str(), r.error().c_str());
      return 1;
    }
    runs[dt] = std::move(*r);
  }
  const Run& ref = runs["bf16"];
  nlohmann::json rows = nlohmann::json::array();
  std::printf("| dense weights | nll | perplexity | vs bf16 | greedy token as bf16 | routing agreement (mean; worst layer) |\n"
              "|---|---|---|---|---|---|\n");
  for (const std::string& dt : variants) {
    const Run& r = runs[dt];
    std::vector<double> agree(size_t(Lm), 0.0);
    int64_t same_greedy = 0;
    const size_t n = std::min(r.experts.size(), ref.experts.size());
    for (size_t p = 0; p < n; ++p) {
      same_greedy += r.greedy[p] == ref.greedy[p];
      for (int l = 0; l < Lm; ++l) {
        int both = 0;
        for (int a = 0; a < K; ++a) {
          const int32_t x = r.experts[p][size_t(l * K + a)];
          if (x < 0) continue;
          for (int b = 0; b < K; ++b) both += x == ref.experts[p][size_t(l * K + b)];
        }
        agree[size_t(l)] += double(both) / K;
      }
    }
    for (double& a : agree) a /= double(std::max<size_t>(n, 1));
    const double mean = Lm ? std::accumulate(agree.begin(), agree.end(), 0.0) / Lm : 1.0;
    const double worst = Lm ? *std::min_element(agree.begin(), agree.end()) : 1.0;
    const double ppl = std::exp(r.nll);
    std::printf("| %s | %.5f | %.4f | %+.2f %% | %.4f | %.4f; %.4f |\n", dt.c_str(), r.nll, ppl,
                100.0 * (ppl / std::exp(ref.nll) - 1.0), double(same_greedy) / double(std::max<size_t>(n, 1)), mean,
                worst);
    rows.push_back({{"dense_weights", dt}, {"nll", r.nll}, {"perplexity", ppl}, {"tokens", r.tokens},
                    {"vs_bf16_percent", 100.0 * (ppl / std::exp(ref.nll) - 1.0)},
                    {"greedy_as_bf16", double(same_greedy) / double(std::max<size_t>(n, 1))},
                    {"routing_agreement_mean", mean}, {"routing_agreement_worst_layer", worst},
                    {"routing_agreement_per_layer", agree}});
  }
  if (!json_out.empty()) std::ofstream(json_out) << nlohmann::json{{"model", model}, {"rows", rows}}.dump(1) << "\n";
  return 0;
}
