// moe perplexity: mean negative log-likelihood of a text under the model, in
// windows of --ctx predicted tokens (engine/perplexity.h says how). Progress
// goes to stderr; the last line of stdout is `nll=… ppl=… tokens=…`.

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <sstream>
#include <string>
#include <vector>

#include "engine/cpu_engine.h"
#include "engine/perplexity.h"
#include "model/model_files.h"
#include "tools/moe/commands.h"
#include "tools/moe/load_tokenizer.h"

namespace moe::cli {

namespace {

void usage(FILE* out) {
  std::fprintf(
      out,
      "usage: moe perplexity --model DIR|FILE --file TEXT [options]\n\n"
      "  --model DIR|FILE   a checkpoint folder, a GGUF file or a packed model file\n"
      "  --file TEXT        the text (special tokens written in it are recognised;\n"
      "                     no BOS unless the tokenizer's post-processor adds one)\n"
      "  --ctx N            predicted tokens per window (default 512)\n"
      "  --max-ids N        use only the first N token ids of the text\n"
      "  --threads N        CPU threads (default: all cores)\n"
      "  --experts bf16|q4  expert weights to use (default: INT4 when the file has them)\n"
      "  --kv-dtype D       the KV cache's rows: bf16 (f32 on this engine, the default), int8 or fp8\n"
      "                     (one byte a value and a scale per row, docs/kv-cache.md)\n");
}

}  // namespace

int cmd_perplexity(int argc, char** argv) {
  std::string model, file, experts, kv = "bf16";
  int ctx = 512, threads = 0;
  long max_ids = 0;
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
    } else if (a == "--ctx" && has_value) {
      ctx = std::atoi(argv[++i]);
    } else if (a == "--max-ids" && has_value) {
      max_ids = std::atol(argv[++i]);
    } else if (a == "--threads" && has_value) {
      threads = std::atoi(argv[++i]);
    } else if (a == "--experts" && has_value) {
      experts = argv[++i];
    } else if (a == "--kv-dtype" && has_value) {
      kv = argv[++i];
    } else {
      std::fprintf(stderr, "moe perplexity: unexpected argument '%s'\n", argv[i]);
      usage(stderr);
      return 2;
    }
  }
  if (model.empty() || file.empty() || ctx < 1 || (!experts.empty() && experts != "bf16" && experts != "q4") ||
      (kv != "bf16" && kv != "int8" && kv != "fp8")) {
    usage(stderr);
    return 2;
  }
  auto text_ids = text_file_ids(model, file);
  if (!text_ids) {
    std::fprintf(stderr, "moe perplexity: %s\n", text_ids.error().c_str());
    return 1;
  }
  std::vector<int32_t> ids = std::move(text_ids.value());
  auto files = ModelFiles::open(model);
  if (!files) {
    std::fprintf(stderr, "moe perplexity: %s\n", files.error().c_str());
    return 1;
  }
  if (max_ids > 0 && ids.size() > size_t(max_ids)) ids.resize(size_t(max_ids));

  EngineOptions opts;
  opts.threads = threads;
  if (!experts.empty()) opts.experts_q4 = experts == "q4";
  opts.kv_dtype = kv == "int8" ? KvDtype::int8 : kv == "fp8" ? KvDtype::fp8 : KvDtype::bf16;
  auto engine = CpuEngine::create(files.value(), opts);
  if (!engine) {
    std::fprintf(stderr, "moe perplexity: %s\n", engine.error().c_str());
    return 1;
  }
  if (ctx + 1 > engine.value()->max_context()) {
    std::fprintf(stderr, "moe perplexity: --ctx %d exceeds the model's context of %d\n", ctx,
                 engine.value()->max_context() - 1);
    return 2;
  }
  std::fprintf(stderr, "%zu tokens, windows of %d, experts %s, KV %s\n", ids.size(), ctx,
               engine.value()->experts_q4() ? "int4" : "bf16", kv.c_str());
  auto r = mean_nll(*engine.value(), ids, ctx, [](int64_t done, int64_t total) {
    std::fprintf(stderr, "\r%lld/%lld tokens", (long long)done, (long long)total);
  });
  std::fprintf(stderr, "\n");
  if (!r) {
    std::fprintf(stderr, "moe perplexity: %s\n", r.error().c_str());
    return 1;
  }
  std::printf("nll=%.4f ppl=%.4f tokens=%lld\n", r->nll, std::exp(r->nll), (long long)r->tokens);
  return 0;
}

}  // namespace moe::cli
