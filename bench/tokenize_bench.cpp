// moe-bench-tokenize: encoding speed of the tokenizer on real text.
//
// usage: moe-bench-tokenize [MODEL_DIR [TEXT_FILE [MB]]]
// Defaults: the demo model's tokenizer and its eval.txt, repeated to ~10 MB.
// Prints MB/s (per CPU second) for encode (fresh tokenizer: the word cache starts empty),
// decode, and the per-token cost of streaming decode.

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <fstream>
#include <sstream>
#include <string>

#include "tokenizer/tokenizer.h"

#ifndef MOE_SOURCE_DIR
#define MOE_SOURCE_DIR "."
#endif

namespace {

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// CPU time of this process: on a loaded machine wall time mostly measures
// the other processes.
double cpu_seconds() { return static_cast<double>(std::clock()) / CLOCKS_PER_SEC; }

}  // namespace

int main(int argc, char** argv) {
  const std::string dir = argc > 1 ? argv[1] : MOE_SOURCE_DIR "/models/demo-moe";
  const std::string text_path = argc > 2 ? argv[2] : dir + "/eval.txt";
  const double target_mb = argc > 3 ? std::atof(argv[3]) : 10.0;

  auto tok = moe::Tokenizer::load_dir(dir);
  if (!tok) {
    std::fprintf(stderr, "moe-bench-tokenize: %s\n", tok.error().c_str());
    return 1;
  }
  std::ifstream in(text_path, std::ios::binary);
  if (!in) {
    std::fprintf(stderr, "moe-bench-tokenize: cannot open %s\n", text_path.c_str());
    return 1;
  }
  std::ostringstream ss;
  ss << in.rdbuf();
  const std::string unit = ss.str();
  if (unit.empty()) return 1;
  std::string text;
  while (text.size() < target_mb * 1e6) text += unit;
  const double mb = static_cast<double>(text.size()) / 1e6;

  auto t0 = std::chrono::steady_clock::now();
  double c0 = cpu_seconds();
  const auto ids = tok.value()->encode(text, false);
  const double enc_s = seconds_since(t0), enc_cpu = cpu_seconds() - c0;

  t0 = std::chrono::steady_clock::now();
  c0 = cpu_seconds();
  const std::string back = tok.value()->decode(ids, false);
  const double dec_s = seconds_since(t0), dec_cpu = cpu_seconds() - c0;

  const size_t n_stream = std::min<size_t>(ids.size(), 200000);
  moe::StreamDecoder sd(*tok.value());
  size_t streamed = 0;
  c0 = cpu_seconds();
  for (size_t i = 0; i < n_stream; ++i) streamed += sd.push(ids[i]).size();
  streamed += sd.flush().size();
  const double stream_cpu = cpu_seconds() - c0;

  std::printf("text: %s x%.1f = %.2f MB, %zu tokens (%.2f bytes/token)\n", text_path.c_str(),
              static_cast<double>(text.size()) / static_cast<double>(unit.size()), mb, ids.size(),
              static_cast<double>(text.size()) / static_cast<double>(ids.size()));
  std::printf("encode: %.1f MB/s (CPU %.3f s; wall %.3f s)\n", mb / enc_cpu, enc_cpu, enc_s);
  std::printf("decode: %.1f MB/s (CPU %.3f s; wall %.3f s), round trip %s\n", mb / dec_cpu, dec_cpu,
              dec_s, back == text ? "exact" : "DIFFERS");
  std::printf("stream decode: %.2f us/token CPU over %zu tokens (%zu bytes)\n",
              stream_cpu * 1e6 / static_cast<double>(n_stream), n_stream, streamed);
  return back == text ? 0 : 1;
}
