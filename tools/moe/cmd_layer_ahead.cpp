// moe layer-ahead: how well each MoE layer's experts can be known before the
// layer runs, on real text (engine/router_lookahead.h says how). One row
// per MoE layer and a mean; --json for a file of the figures.

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "engine/cpu_engine.h"
#include "engine/router_lookahead.h"
#include "model/model_files.h"
#include "tools/moe/commands.h"
#include "tools/moe/load_tokenizer.h"

namespace moe::cli {

namespace {

void usage(FILE* out) {
  std::fprintf(out,
               "usage: moe layer-ahead --model DIR|FILE --file TEXT [options]\n\n"
               "Runs the text through the CPU engine and scores, per MoE layer, guesses of the experts each\n"
               "token will be routed to, made before the layer runs: the layer's own router on an earlier\n"
               "hidden state (the previous layer's residual after its attention, with k and 2k guesses; the\n"
               "residual entering the layer; two layers back), against the transition table learned online\n"
               "from the previous layer's experts and the layer's most used experts so far. Figures are the\n"
               "mean recall of the true top-k.\n\n"
               "  --model DIR|FILE   a checkpoint folder, a GGUF file or a packed model file\n"
               "  --file TEXT        the text\n"
               "  --tokens N         score the first N tokens (default 4096)\n"
               "  --window N         tokens per forward pass, each a fresh sequence (default 512)\n"
               "  --threads N        CPU threads (default: all cores)\n"
               "  --json FILE        also write the figures as JSON\n");
}

}  // namespace

int cmd_layer_ahead(int argc, char** argv) {
  std::string model, file, json_out;
  int tokens = 4096, window = 512, threads = 0;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    const bool has_value = i + 1 < argc;
    if (a == "--help" || a == "-h") {
      usage(stdout);
      return 0;
    } else if (a == "--model" && has_value) {
      model = argv[++i];
    } else if (a == "--file" && has_value) {
      file = argv[++i];
    } else if (a == "--tokens" && has_value) {
      tokens = std::atoi(argv[++i]);
    } else if (a == "--window" && has_value) {
      window = std::atoi(argv[++i]);
    } else if (a == "--threads" && has_value) {
      threads = std::atoi(argv[++i]);
    } else if (a == "--json" && has_value) {
      json_out = argv[++i];
    } else {
      std::fprintf(stderr, "moe layer-ahead: unexpected argument '%s'\n", argv[i]);
      usage(stderr);
      return 2;
    }
  }
  if (model.empty() || file.empty() || tokens < 1 || window < 1) {
    usage(stderr);
    return 2;
  }
  auto files = ModelFiles::open(model);
  if (!files) {
    std::fprintf(stderr, "moe layer-ahead: %s\n", files.error().c_str());
    return 1;
  }
  const ModelDesc& d = files.value()->desc();
  if (d.n_moe_layers() == 0) {
    std::fprintf(stderr, "moe layer-ahead: %s has no MoE layers\n", model.c_str());
    return 1;
  }
  auto text_ids = text_file_ids(model, file);
  if (!text_ids) {
    std::fprintf(stderr, "moe layer-ahead: %s\n", text_ids.error().c_str());
    return 1;
  }
  std::vector<int32_t> ids = std::move(text_ids.value());
  if (ids.size() > size_t(tokens)) ids.resize(size_t(tokens));
  EngineOptions opts;
  opts.threads = threads;
  auto engine = CpuEngine::create(files.value(), opts);
  if (!engine) {
    std::fprintf(stderr, "moe layer-ahead: %s\n", engine.error().c_str());
    return 1;
  }
  window = std::min(window, engine.value()->max_context());
  RouterLookahead la(d, engine.value()->weights());
  for (size_t at = 0; at < ids.size(); at += size_t(window)) {
    const size_t n = std::min(ids.size() - at, size_t(window));
    ForwardTrace trace;
    auto r = engine.value()->forward_logits(std::span<const int32_t>(ids.data() + at, n), &trace);
    if (!r) {
      std::fprintf(stderr, "moe layer-ahead: %s\n", r.error().c_str());
      return 1;
    }
    la.add(trace, int(n));
    std::fprintf(stderr, "\r%zu/%zu tokens", at + n, ids.size());
  }
  std::fprintf(stderr, "\n");
  const std::vector<LookaheadLayer> rows = la.layers();
  std::printf("%zu tokens, %d experts, top-%d; mean recall of the true top-%d\n", ids.size(), d.moe.n_experts,
              d.moe.top_k, d.moe.top_k);
  std::printf("%5s  %10s %10s %10s %10s %10s %10s\n", "layer", "prev-attn", "prev-2k", "entering", "two-back",
              "transition", "frequency");
  // Each figure's mean over the layers it exists for: the previous model
  // layer's state from model layer 1 on, two back from 2, the transition
  // from the second MoE layer on (the first MoE layer may be deeper than 0).
  LookaheadLayer mean;
  int with_prev = 0, with_two = 0, with_trans = 0;
  for (size_t m = 0; m < rows.size(); ++m) {
    const LookaheadLayer& r = rows[m];
    std::printf("%5d  %10.3f %10.3f %10.3f %10.3f %10.3f %10.3f\n", r.layer, r.after_attention_prev,
                r.after_attention_prev_2k, r.entering, r.two_ahead, r.transition, r.frequency);
    if (r.layer >= 1) {
      ++with_prev;
      mean.after_attention_prev += r.after_attention_prev;
      mean.after_attention_prev_2k += r.after_attention_prev_2k;
    }
    if (m >= 1) {
      ++with_trans;
      mean.transition += r.transition;
    }
    if (r.layer >= 2) {
      ++with_two;
      mean.two_ahead += r.two_ahead;
    }
    mean.entering += r.entering;
    mean.frequency += r.frequency;
  }
  const double np = std::max(with_prev, 1), nt = std::max(with_two, 1), nx = std::max(with_trans, 1),
               na = double(rows.size());
  std::printf("%5s  %10.3f %10.3f %10.3f %10.3f %10.3f %10.3f\n", "mean", mean.after_attention_prev / np,
              mean.after_attention_prev_2k / np, mean.entering / na, mean.two_ahead / nt, mean.transition / nx,
              mean.frequency / na);
  if (!json_out.empty()) {
    nlohmann::json j = {{"model", model},       {"text", file},           {"tokens", ids.size()},
                        {"n_experts", d.moe.n_experts}, {"top_k", d.moe.top_k}, {"layers", nlohmann::json::array()}};
    for (const LookaheadLayer& r : rows)
      j["layers"].push_back({{"layer", r.layer},
                             {"prev_after_attention", r.after_attention_prev},
                             {"prev_after_attention_2k", r.after_attention_prev_2k},
                             {"entering", r.entering},
                             {"two_back", r.two_ahead},
                             {"transition", r.transition},
                             {"frequency", r.frequency}});
    std::ofstream o(json_out);
    o << j.dump(1) << "\n";
    if (!o) {
      std::fprintf(stderr, "moe layer-ahead: cannot write %s\n", json_out.c_str());
      return 1;
    }
  }
  return 0;
}

}  // namespace moe::cli
