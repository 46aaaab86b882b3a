// CPU engine speed on a model (default: the demo model): prefill tokens/s,
// and decode tokens/s with 1 and with 8 sequences in each step.
//
//   cpu_engine_bench [--model DIR|FILE] [--threads N] [--prefill 512] [--decode 128]
//                    [--q4 0|1]

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "engine/cpu_engine.h"

namespace {

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// Decode `steps` tokens for each of `n_seqs` sequences, all in one batch per
// step, after a short prompt. Returns generated tokens per second.
double decode_rate(moe::CpuEngine& e, int n_seqs, int steps) {
  std::vector<moe::SeqInput> in(static_cast<size_t>(n_seqs));
  for (int i = 0; i < n_seqs; ++i) {
    in[size_t(i)].seq_id = uint64_t(1000 + i);
    for (int t = 0; t < 16; ++t)
      in[size_t(i)].tokens.push_back((t * 37 + i * 11) % e.desc().vocab_size);
    in[size_t(i)].sampling.temperature = 0.8f;
    in[size_t(i)].sampling.seed = uint64_t(i);
  }
  auto first = e.step(in);  // the prompts, not timed
  if (!first) {
    std::fprintf(stderr, "step failed: %s\n", first.error().c_str());
    std::exit(1);
  }
  for (int i = 0; i < n_seqs; ++i) {
    in[size_t(i)].start_pos = 16;
    in[size_t(i)].tokens = {(*first)[size_t(i)].token};
  }
  const double t0 = now_s();
  for (int s = 0; s < steps; ++s) {
    auto out = e.step(in);
    if (!out) {
      std::fprintf(stderr, "step failed: %s\n", out.error().c_str());
      std::exit(1);
    }
    for (int i = 0; i < n_seqs; ++i) {
      in[size_t(i)].start_pos += 1;
      in[size_t(i)].tokens = {(*out)[size_t(i)].token};
    }
  }
  const double dt = now_s() - t0;
  for (int i = 0; i < n_seqs; ++i) e.release(uint64_t(1000 + i));
  return double(n_seqs) * steps / dt;
}

double prefill_rate(moe::CpuEngine& e, int tokens, int reps) {
  moe::SeqInput in;
  in.seq_id = 1;
  for (int t = 0; t < tokens; ++t) in.tokens.push_back((t * 101 + 7) % e.desc().vocab_size);
  in.sampling.temperature = 0;
  const double t0 = now_s();
  for (int r = 0; r < reps; ++r) {
    auto out = e.step(std::span<const moe::SeqInput>(&in, 1));
    if (!out) {
      std::fprintf(stderr, "step failed: %s\n", out.error().c_str());
      std::exit(1);
    }
  }
  const double dt = now_s() - t0;
  e.release(1);
  return double(tokens) * reps / dt;
}

}  // namespace

int main(int argc, char** argv) {
  std::string model = "models/demo-moe";
  int threads = 0, prefill = 512, decode = 128, q4 = -1;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i];
    if (a == "--model")
      model = argv[i + 1];
    else if (a == "--threads")
      threads = std::atoi(argv[i + 1]);
    else if (a == "--prefill")
      prefill = std::atoi(argv[i + 1]);
    else if (a == "--decode")
      decode = std::atoi(argv[i + 1]);
    else if (a == "--q4")
      q4 = std::atoi(argv[i + 1]);
    else {
      std::fprintf(stderr, "unknown option %s\n", a.c_str());
      return 2;
    }
  }
  auto files = moe::ModelFiles::open(model);
  if (!files) {
    std::fprintf(stderr, "%s\n", files.error().c_str());
    return 1;
  }
  moe::EngineOptions opts;
  opts.threads = threads;
  if (q4 >= 0) opts.experts_q4 = q4 == 1;
  auto e = moe::CpuEngine::create(files.value(), opts);
  if (!e) {
    std::fprintf(stderr, "%s\n", e.error().c_str());
    return 1;
  }
  moe::CpuEngine& eng = *e.value();
  std::printf("model %s, %d threads, experts %s\n", model.c_str(), eng.threads(),
              eng.experts_q4() ? "int4" : "f32");
  decode_rate(eng, 1, 8);  // warm-up: pages touched, threads started
  std::printf("prefill %d tokens:      %8.0f tokens/s\n", prefill, prefill_rate(eng, prefill, 3));
  std::printf("decode, 1 sequence:    %8.1f tokens/s\n", decode_rate(eng, 1, decode));
  std::printf("decode, 8 sequences:   %8.1f tokens/s\n", decode_rate(eng, 8, decode));
  return 0;
}
