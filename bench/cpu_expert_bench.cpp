// Whether the host should compute a missed expert instead of copying it to
// the GPU (the CUDA issue's question for small batches): the time the CPU
// engine's INT4 matvecs take for one token through one expert of the
// Qwen3-30B-A3B and Qwen1.5-MoE-A2.7B shapes, on one core and on every core
// at once (distinct experts per thread, as a layer's misses would be), set
// against the copy: blob bytes / the link's measured bandwidth. Then the
// latency that matters to the CUDA engine's miss split: ONE expert-token
// with its rows spread over a thread pool (cuda_engine/host_experts.h), with
// f32 and with int8 inputs, at 1, 2, 4, ... threads. Last, the host's share
// of one layer of a streamed pass of 8 tokens (cuda_engine/host_share.h) as
// the tokens share more of their experts.
//   cpu_expert_bench [--link-gbs 52.3] [--seconds 2]
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "cuda_engine/host_experts.h"
#include "cuda_engine/host_share.h"
#include "kernels/cpu/activation.h"
#include "model/int4.h"
#include "model/safetensors.h"

namespace {

using Clock = std::chrono::steady_clock;

struct Shape {
  const char* name;
  int hidden, inter;
};

// One expert for one token: gate, up, SiLU product, down.
void run_expert(const uint8_t* blob, const moe::ExpertLayout& L, const float* x, float* g, float* u, float* y) {
  moe::q4_matvec(blob, L.gate, x, g);
  moe::q4_matvec(blob, L.up, x, u);
  for (int i = 0; i < L.inter; ++i) g[i] = g[i] / (1.f + std::exp(-g[i])) * u[i];
  moe::q4_matvec(blob, L.down, g, y);
}

}  // namespace

int main(int argc, char** argv) {
  double link_gbs = 52.3;  // the link alone (moe-bench-kernels --only copy) on the H200's PCIe Gen5 x16
  double seconds = 2;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!std::strcmp(argv[i], "--link-gbs")) link_gbs = std::atof(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--seconds")) seconds = std::atof(argv[i + 1]);
  }
  const int cores = int(std::max(1u, std::thread::hardware_concurrency()));
  std::printf("cpu_expert_bench: %d cores, link %.1f GB/s\n\n", cores, link_gbs);
  std::printf("| shape | blob MB | copy us | CPU us/expert (1 core) | CPU experts/ms (%d cores) | link experts/ms | both together |\n",
              cores);
  std::printf("|---|---|---|---|---|---|---|\n");
  struct SplitInput {
    Shape shape;
    std::vector<uint8_t> blobs;
    int n_blobs;
  };
  std::vector<SplitInput> split_rows;
  for (const Shape s : {Shape{"Qwen3-30B-A3B", 2048, 768}, Shape{"Qwen1.5-MoE-A2.7B", 2048, 1408}}) {
    const moe::ExpertLayout L = moe::expert_layout(s.hidden, s.inter, 64);
    // Enough distinct experts that they do not stay in the caches.
    const int n_blobs = std::max(64, 4 * cores);
    std::vector<uint8_t> blobs(size_t(n_blobs) * L.blob_bytes);
    std::mt19937 rng(1);
    for (auto& b : blobs) b = uint8_t(rng());
    for (int e = 0; e < n_blobs; ++e)
      for (const moe::Q4MatrixLayout* m : {&L.gate, &L.up, &L.down}) {
        auto* params = reinterpret_cast<uint16_t*>(blobs.data() + size_t(e) * L.blob_bytes + m->params_offset);
        for (size_t i = 0; i < m->params_bytes() / 4; ++i) params[2 * i] = 0x1400, params[2 * i + 1] = 0x9000;
      }
    auto measure = [&](int threads) {
      std::atomic<long> done{0};
      std::atomic<bool> stop{false};
      std::vector<std::thread> pool;
      for (int t = 0; t < threads; ++t)
        pool.emplace_back([&, t] {
          std::vector<float> x(size_t(s.hidden), 0.5f), g(size_t(s.inter)), u(size_t(s.inter)), y(size_t(s.hidden));
          long n = 0;
          for (int e = t; !stop.load(std::memory_order_relaxed); e = (e + threads) % n_blobs, ++n)
            run_expert(blobs.data() + size_t(e) * L.blob_bytes, L, x.data(), g.data(), u.data(), y.data());
          done += n;
        });
      const auto t0 = Clock::now();
      std::this_thread::sleep_for(std::chrono::duration<double>(seconds));
      stop = true;
      for (auto& th : pool) th.join();
      return double(done) / std::chrono::duration<double, std::milli>(Clock::now() - t0).count();  // experts/ms
    };
    const double one = measure(1), all = measure(cores);
    const double copy_us = double(L.blob_bytes) / (link_gbs * 1e3);
    std::printf("| %s | %.2f | %.1f | %.0f | %.1f | %.1f | %.1f |\n", s.name, L.blob_bytes / 1e6, copy_us, 1000.0 / one,
                all, 1000.0 / copy_us, all + 1000.0 / copy_us);
    std::fflush(stdout);
    split_rows.push_back({s, blobs, n_blobs});
  }
  // One expert-token split over a pool: the host side of the engine's split.
  std::printf("\n| shape | inputs | threads | us per expert-token (median) | GB/s of weights |\n|---|---|---|---|---|\n");
  for (const SplitInput& si : split_rows) {
    const moe::ExpertLayout L = moe::expert_layout(si.shape.hidden, si.shape.inter, 64);
    std::vector<uint16_t> x(size_t(L.hidden));
    std::mt19937 rng(3);
    std::normal_distribution<float> nd(0.f, 1.f);
    for (auto& v : x) v = moe::f32_to_bf16(nd(rng));
    std::vector<float> y(size_t(L.hidden));
    for (const bool int8 : {false, true})
      for (int threads = 1; threads <= cores; threads *= 2) {
        moe::HostExperts hx(L, threads, int8);
        std::vector<double> us;
        for (int i = 0; i < 200; ++i) {
          // A distinct blob each time, as misses are: nothing stays cached.
          const moe::HostPair pair{0, si.blobs.data() + size_t(i % si.n_blobs) * L.blob_bytes, 1.f};
          const auto t0 = Clock::now();
          hx.run(x.data(), 1, std::span<const moe::HostPair>(&pair, 1), y.data());
          if (i >= 8) us.push_back(std::chrono::duration<double, std::micro>(Clock::now() - t0).count());
          // a decode layer's gap between host calls, so the pool's spin ends as it would
          std::this_thread::sleep_for(std::chrono::microseconds(150));
        }
        std::sort(us.begin(), us.end());
        const double med = us[us.size() / 2];
        std::printf("| %s | %s | %d | %.0f | %.1f |\n", si.shape.name, int8 ? "int8" : "f32", threads, med,
                    L.blob_bytes / (med * 1e3));
        std::fflush(stdout);
        if (threads < cores && threads * 2 > cores) threads = cores / 2;  // end on every core
      }
  }
  // The host's share of one layer of a streamed pass of 8 tokens, driven as
  // the engine drives it (a post in the layer's slot, then the wait for
  // done): 64 (token, expert) pairs, the first third of each pair's rows,
  // over fewer distinct experts as the tokens share more of them.
  std::printf("\n| shape | tokens | pairs | distinct experts | rows of each | threads | us a layer (median) | "
              "GB/s of weights read once an expert |\n|---|---|---|---|---|---|---|---|\n");
  for (const SplitInput& si : split_rows) {
    const moe::ExpertLayout L = moe::expert_layout(si.shape.hidden, si.shape.inter, 64);
    const int tokens = moe::kShareMaxTokens, per_token = 8, pairs = tokens * per_token;
    const int rows = L.inter / 3 / 64 * 64;
    std::vector<const uint8_t*> blobs;
    for (int e = 0; e < si.n_blobs; ++e) blobs.push_back(si.blobs.data() + size_t(e) * L.blob_bytes);
    moe::ShareSlot slot{};
    std::vector<uint16_t> xs(size_t(moe::kShareMaxTokens) * L.hidden);
    std::vector<float> sums(xs.size());
    std::mt19937 rng(5);
    std::normal_distribution<float> nd(0.f, 1.f);
    for (auto& v : xs) v = moe::f32_to_bf16(nd(rng));
    moe::HostShare share(L, 1, si.n_blobs, blobs, moe::ShareMemory{&slot, xs.data(), sums.data()}, cores);
    uint32_t pass = 0;
    for (const int distinct : {64, 48, 32, 16}) {
      if (distinct > si.n_blobs) continue;
      std::vector<double> us;
      int used = 0;  // the distinct experts the pairs name
      for (int rep = 0; rep < 40; ++rep) {
        // Token t's j-th expert: distinct experts in all, each token's
        // distinct, a new set each rep (so that little stays cached).
        const int base = rep * distinct;
        for (int t = 0; t < tokens; ++t)
          for (int j = 0; j < per_token; ++j) {
            const int p = t * per_token + j;
            slot.expert[p] = int32_t((base + (t * per_token + j * 7 + t) % distinct) % si.n_blobs);
            slot.token[p] = uint8_t(t);
            slot.weight[p] = 0.125f;
          }
        std::vector<char> named(size_t(si.n_blobs), 0);
        for (int p = 0; p < pairs; ++p) named[size_t(slot.expert[p])] = 1;
        used = int(std::count(named.begin(), named.end(), 1));
        slot.count = uint32_t(pairs);
        slot.rows = uint32_t(rows);
        slot.tokens = uint32_t(tokens);
        share.begin(++pass);
        const auto t0 = Clock::now();
        std::atomic_ref<uint32_t>(slot.posted).store(pass, std::memory_order_release);
        while (std::atomic_ref<uint32_t>(slot.done).load(std::memory_order_acquire) != pass) {
        }
        if (rep >= 4) us.push_back(std::chrono::duration<double, std::micro>(Clock::now() - t0).count());
        share.end(true);
      }
      std::sort(us.begin(), us.end());
      const double med = us[us.size() / 2];
      const double bytes = double(used) * L.blob_bytes * double(rows) / L.inter;
      std::printf("| %s | %d | %d | %d | %d of %d | %d | %.0f | %.1f |\n", si.shape.name, tokens, pairs, used,
                  rows, L.inter, cores, med, bytes / (med * 1e3));
      std::fflush(stdout);
    }
  }
  return 0;
}
