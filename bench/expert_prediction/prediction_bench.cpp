// moe-bench-expert-prediction: how well a prompt's embedding hash predicts
// the experts the demo model (or any model) really routes it to, against an
// uninformed prediction from the global expert frequencies.
//
// The eval text is cut into prompts of --window tokens; each runs through
// the CPU engine (prefill, then --decode greedy tokens) and its expert use is
// recorded. Prompts alternate between a training and a test half:
//   interleaved  consecutive prompts alternate (a test prompt's neighbours in
//                the same file were seen in training)
//   blocked      runs of --block prompts alternate (test text comes from
//                other parts of the corpus than anything trained on)
// The gateway's own predictor (gateway/expert_prediction.h) learns every
// training prompt, then predicts each test prompt; per MoE layer the top N
// predicted experts are compared with what the prompt used:
//   precision@N  share of the predicted N that are among the prompt's own N
//                most used experts
//   coverage@N   share of the prompt's expert-token assignments that fall on
//                the predicted N (the hit rate of a residency holding only them)
//   used@N       share of the predicted N the prompt used at all (what the
//                gateway's moe_gateway_prediction_hits_total counts)
// The baseline is the same table's global row (every prompt gets the overall
// most used experts); "random" is N / n_experts for coverage. "neighbour"
// predicts each test prompt from the one text window before it (a training
// prompt in the interleaved split): what the closest possible text alone tells.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <numeric>
#include <sstream>
#include <string>
#include <vector>

#include "engine/cpu_engine.h"
#include "gateway/predict/expert_prediction.h"
#include "gateway/api/model_text_codec.h"

using namespace moe;
using namespace moe::gw;

namespace {

struct Prompt {
  std::vector<int32_t> tokens;
  std::vector<float> usage;  // [layer * n_experts + expert]: tokens served
};

struct Scores {
  double precision = 0, coverage = 0, used = 0;
  int n = 0;
  void add(const std::vector<std::vector<int>>& pred, const std::vector<float>& usage, int E,
           int N) {
    const int L = int(pred.size());
    for (int l = 0; l < L; ++l) {
      const float* u = usage.data() + size_t(l) * size_t(E);
      std::vector<int> order(static_cast<size_t>(E));
      std::iota(order.begin(), order.end(), 0);
      std::stable_sort(order.begin(), order.end(), [u](int a, int b) { return u[a] > u[b]; });
      const double total = std::accumulate(u, u + E, 0.0);
      int in_top = 0, used_any = 0;
      double mass = 0;
      for (int e : pred[size_t(l)]) {
        if (std::find(order.begin(), order.begin() + N, e) != order.begin() + N) ++in_top;
        if (u[e] > 0) ++used_any;
        mass += u[e];
      }
      precision += double(in_top) / N;
      used += double(used_any) / N;
      coverage += total > 0 ? mass / total : 0;
      ++n;
    }
  }
  void print(const char* name) const {
    std::printf("    %-10s precision %.3f  coverage %.3f  used %.3f\n", name, precision / n,
                coverage / n, used / n);
  }
};

std::string read_file(const std::string& path) {
  std::ifstream f(path);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

}  // namespace

int main(int argc, char** argv) {
  std::string model = "models/demo-moe", text = "models/demo-moe/eval.txt", split = "both";
  int window = 64, decode = 16, max_prompts = 600, block = 16, threads = 2, near = 4;
  double prior = 0.5;
  std::vector<int> bits_list = {8, 12, 14, 16}, n_list = {4, 8};
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i], v = argv[i + 1];
    if (a == "--model")
      model = v;
    else if (a == "--text")
      text = v;
    else if (a == "--window")
      window = std::atoi(v.c_str());
    else if (a == "--decode")
      decode = std::atoi(v.c_str());
    else if (a == "--max-prompts")
      max_prompts = std::atoi(v.c_str());
    else if (a == "--block")
      block = std::atoi(v.c_str());
    else if (a == "--threads")
      threads = std::atoi(v.c_str());
    else if (a == "--split")
      split = v;
    else if (a == "--prior")
      prior = std::atof(v.c_str());
    else if (a == "--near")
      near = std::atoi(v.c_str());
    else {
      std::fprintf(
          stderr,
          "usage: moe-bench-expert-prediction [--model DIR] [--text FILE] [--window N] [--decode "
          "N]\n"
          "       [--max-prompts N] [--block N] [--threads N] [--split interleaved|blocked|both]\n"
          "       [--prior SUMMARIES] [--near HAMMING]\n");
      return 2;
    }
  }
  auto codec = load_model_text_codec(model);
  auto files = ModelFiles::open(model);
  if (!codec.ok() || !files.ok()) {
    std::fprintf(stderr, "cannot open %s: %s\n", model.c_str(),
                 codec.ok() ? files.error().c_str() : codec.error().c_str());
    return 1;
  }
  EngineOptions eo;
  eo.threads = threads;
  auto engine = CpuEngine::create(files.value(), eo);
  if (!engine.ok()) {
    std::fprintf(stderr, "engine: %s\n", engine.error().c_str());
    return 1;
  }
  const int L = files.value()->desc().n_moe_layers(), E = files.value()->desc().moe.n_experts;
  const std::vector<int32_t> all = codec.value()->encode(read_file(text));
  std::vector<Prompt> prompts;
  for (size_t at = 0; at + size_t(window) <= all.size() && int(prompts.size()) < max_prompts;
       at += size_t(window))
    prompts.push_back(
        {std::vector<int32_t>(all.begin() + long(at), all.begin() + long(at) + window), {}});
  std::printf(
      "model %s, text %s: %zu tokens, %zu prompts of %d tokens, %d decoded each; %d MoE layers x "
      "%d experts, top-%d\n",
      model.c_str(), text.c_str(), all.size(), prompts.size(), window, decode, L, E,
      files.value()->desc().moe.top_k);

  // Expert use of every prompt: prefill and greedy decode, 8 at a time.
  const auto t0 = std::chrono::steady_clock::now();
  for (size_t b = 0; b < prompts.size(); b += 8) {
    const size_t e = std::min(prompts.size(), b + 8);
    std::vector<SeqInput> in;
    for (size_t i = b; i < e; ++i) {
      prompts[i].usage.assign(size_t(L) * size_t(E), 0.0f);
      SeqInput s;
      s.seq_id = i + 1;
      s.tokens = prompts[i].tokens;
      s.sample = decode > 0;
      s.sampling.temperature = 0;
      in.push_back(std::move(s));
    }
    for (int step = 0; step <= decode; ++step) {
      auto out = engine.value()->step(in);
      if (!out.ok()) {
        std::fprintf(stderr, "step: %s\n", out.error().c_str());
        return 1;
      }
      for (size_t k = 0; k < out->size(); ++k) {
        auto& u = prompts[b + k].usage;
        for (size_t x = 0; x < (*out)[k].expert_counts.size() && x < u.size(); ++x)
          u[x] += (*out)[k].expert_counts[x];
        in[k].start_pos += int32_t(in[k].tokens.size());
        in[k].tokens = {(*out)[k].token};
      }
      if (step + 1 >= decode) break;  // the last sampled token is not run
    }
    for (size_t i = b; i < e; ++i) engine.value()->release(i + 1);
  }
  std::printf("engine: %.1f s\n",
              std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());

  for (const std::string& how : {std::string("interleaved"), std::string("blocked")}) {
    if (split != "both" && split != how) continue;
    auto is_train = [&](size_t i) {
      return how == "interleaved" ? i % 2 == 0 : (i / size_t(block)) % 2 == 0;
    };
    for (int bits : bits_list) {
      PredictorOptions po;
      po.lsh_bits = bits;
      po.experts_per_layer = *std::max_element(n_list.begin(), n_list.end());
      po.table.half_life = 1e9;  // a fixed corpus: no decay
      po.table.prior_summaries = prior;
      po.table.nearest_max_distance = near;
      auto pred = PromptExpertPredictor::open(model, po);
      if (!pred.ok()) {
        std::fprintf(stderr, "predictor: %s\n", pred.error().c_str());
        return 1;
      }
      size_t trained = 0;
      for (size_t i = 0; i < prompts.size(); ++i)
        if (is_train(i)) {
          pred.value()->learn(pred.value()->bucket_of(prompts[i].tokens), prompts[i].usage);
          ++trained;
        }
      std::printf("\nsplit %s, %d-bit LSH: trained on %zu prompts, %zu buckets\n", how.c_str(),
                  bits, trained, pred.value()->stats().buckets);
      int sources[4] = {0, 0, 0, 0};
      for (int N : n_list) {
        Scores hashed, global, neighbour;
        for (size_t i = 0; i < prompts.size(); ++i) {
          if (is_train(i)) continue;
          const uint32_t bucket = pred.value()->bucket_of(prompts[i].tokens);
          const auto est = pred.value()->table().estimate(bucket);
          if (N == n_list[0]) ++sources[int(est.source)];
          hashed.add(ExpertFrequencyTable::top_experts(est, E, N), prompts[i].usage, E, N);
          ExpertFrequencyTable::Estimate g = est;
          // The uninformed baseline: a bucket nobody has seen, far from all.
          g = pred.value()->table().estimate(0xffffffffu);
          if (g.source != ExpertFrequencyTable::Source::global) {
            std::fprintf(stderr, "baseline bucket is known\n");
            return 1;
          }
          global.add(ExpertFrequencyTable::top_experts(g, E, N), prompts[i].usage, E, N);
          if (i > 0) {
            ExpertFrequencyTable::Estimate nb;
            nb.p = prompts[i - 1].usage;
            neighbour.add(ExpertFrequencyTable::top_experts(nb, E, N), prompts[i].usage, E, N);
          }
        }
        std::printf("  top-%d of %d per layer (random coverage %.3f):\n", N, E, double(N) / E);
        hashed.print("hashed");
        global.print("global");
        if (how == "interleaved") neighbour.print("neighbour");
      }
      std::printf("  test prompts by source: bucket %d, nearest %d, global %d\n", sources[0],
                  sources[1], sources[2]);
      // What one prediction costs the gateway's loop (embedding, hash, estimate, top-N).
      const auto p0 = std::chrono::steady_clock::now();
      size_t predicted = 0, known = 0;
      for (int rep = 0; rep < 5; ++rep)
        for (const Prompt& q : prompts) {
          known += pred.value()->predict(q.tokens).known();
          ++predicted;
        }
      const double us =
          std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - p0).count();
      std::printf("  predict(): %.1f us per %d-token prompt (%zu of %zu known)\n",
                  us / double(predicted), window, known, predicted);
    }
  }
  return 0;
}
