// moe convert: packs a checkpoint folder or a GGUF file into one packed model file
// (docs/packed-format.md), with the routed experts quantised to INT4.

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "model/model_files.h"
#include "model/packed_model.h"
#include "tools/moe/commands.h"

namespace moe::cli {

namespace {

void usage(FILE* out) {
  std::fprintf(
      out,
      "usage: moe convert --model DIR|FILE --out FILE [--group-size 32|64|128] [--no-quantize]\n\n"
      "  --model DIR|FILE   a checkpoint folder: config.json, model.safetensors (or shards\n"
      "                     with model.safetensors.index.json), tokenizer files; or a GGUF\n"
      "                     file (its quantised experts become INT4 of group 32 as when served)\n"
      "  --out FILE         the packed model file to write (written to FILE.tmp, then renamed)\n"
      "  --group-size G     INT4 group size along each row's inputs (default 64); a GPTQ or\n"
      "                     AWQ folder or a GGUF keeps its INT4 experts and their group size\n"
      "  --no-quantize      keep the routed experts as stored (bf16) instead of INT4\n");
}

// One progress line on stderr, redrawn in place.
class ProgressLine {
 public:
  void update(size_t done, size_t total, uint64_t bytes_done, uint64_t bytes_total) {
    const auto now = std::chrono::steady_clock::now();
    if (done != total && done != 0 && now - last_ < std::chrono::milliseconds(100)) return;
    last_ = now;
    constexpr int kWidth = 30;
    const double frac = bytes_total ? double(bytes_done) / double(bytes_total) : 1.0;
    char bar[kWidth + 1];
    for (int i = 0; i < kWidth; ++i) bar[i] = i < int(frac * kWidth) ? '#' : '.';
    bar[kWidth] = '\0';
    std::fprintf(stderr, "\r[%s] %zu/%zu tensors, %.1f/%.1f MB", bar, done, total,
                 double(bytes_done) / 1e6, double(bytes_total) / 1e6);
    std::fflush(stderr);
  }

 private:
  std::chrono::steady_clock::time_point last_{};
};

}  // namespace

int cmd_convert(int argc, char** argv) {
  std::string model, out;
  PackOptions opts;
  for (int i = 1; i < argc; ++i) {
    const bool has_value = i + 1 < argc;
    if (!std::strcmp(argv[i], "--model") && has_value) {
      model = argv[++i];
    } else if (!std::strcmp(argv[i], "--out") && has_value) {
      out = argv[++i];
    } else if (!std::strcmp(argv[i], "--group-size") && has_value) {
      char* end = nullptr;
      const long g = std::strtol(argv[++i], &end, 10);
      if (*end != '\0' || (g != 32 && g != 64 && g != 128)) {
        std::fprintf(stderr, "moe convert: --group-size must be 32, 64 or 128, not '%s'\n",
                     argv[i]);
        return 2;
      }
      opts.group_size = int(g);
    } else if (!std::strcmp(argv[i], "--no-quantize")) {
      opts.quantize_experts = false;
    } else if (!std::strcmp(argv[i], "--help") || !std::strcmp(argv[i], "-h")) {
      usage(stdout);
      return 0;
    } else {
      std::fprintf(stderr, "moe convert: unexpected argument '%s'\n", argv[i]);
      usage(stderr);
      return 2;
    }
  }
  if (model.empty() || out.empty()) {
    std::fprintf(stderr, "moe convert: both --model and --out are required\n");
    usage(stderr);
    return 2;
  }

  ProgressLine progress;
  opts.progress = [&](size_t d, size_t t, uint64_t bd, uint64_t bt) {
    progress.update(d, t, bd, bt);
  };
  const auto t0 = std::chrono::steady_clock::now();
  Status s = write_packed_model(model, out, opts);
  std::fprintf(stderr, "\n");
  if (!s) {
    std::fprintf(stderr, "moe convert: %s\n", s.error().c_str());
    return 1;
  }
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  // The group written (a GPTQ/AWQ folder or a GGUF keeps its own).
  auto written = ModelFiles::open(out);
  const std::string experts = !written ? "?" : written.value()->experts_q4()
                                                   ? "INT4, group " + std::to_string(written.value()->q4_group())
                                                   : "as stored";
  std::fprintf(stderr, "moe convert: wrote %s (experts %s) in %.1f s\n", out.c_str(), experts.c_str(), secs);
  return 0;
}

}  // namespace moe::cli
