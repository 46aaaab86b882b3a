// The host side of the CUDA engine's miss split: the plan that balances host
// and link, and the experts computed on a thread pool against the CPU
// engine's matvec one pair at a time.
#include "cuda_engine/host_experts.h"
#include "cuda_engine/host_share.h"

#include <atomic>
#include <catch2/catch.hpp>
#include <thread>
#include <cmath>
#include <random>
#include <vector>

#include "kernels/cpu/activation.h"
#include "model/int4.h"
#include "model/safetensors.h"

using namespace moe;

namespace {

std::vector<uint8_t> random_expert(const ExpertLayout& L, std::mt19937& rng) {
  std::vector<uint8_t> blob(L.blob_bytes, 0);
  std::normal_distribution<float> nd(0.f, 0.05f);
  for (const Q4MatrixLayout* m : {&L.gate, &L.up, &L.down}) {
    std::vector<float> w(size_t(m->rows) * m->cols);
    for (auto& v : w) v = nd(rng);
    q4_quantize_matrix(w.data(), *m, blob.data());
  }
  return blob;
}

}  // namespace

TEST_CASE("plan_split gives the host what it finishes before the link would", "[host_experts]") {
  // Link 50 us an expert; host 60 us a token plus 20 once.
  const std::vector<MissCost> three = {{7, 1}, {9, 1}, {4, 1}};
  // 7: host 80 against link 50 -> link; 9: host 80 against 100 -> host;
  // 4: host 140 against 100 -> link.
  CHECK(plan_split(three, 50, 60, 20) == std::vector<int>{9});
  // Fewest tokens first: a many-token miss stays on the link.
  const std::vector<MissCost> mixed = {{1, 9}, {2, 1}, {3, 1}};
  CHECK(plan_split(mixed, 50, 60, 20) == std::vector<int>{3});
  // A host much faster than the link takes everything; a slow one nothing.
  CHECK(plan_split(three, 50, 5, 5).size() == 3);
  CHECK(plan_split(three, 50, 500, 20).empty());
  CHECK(plan_split({}, 50, 60, 20).empty());
}

TEST_CASE("host experts match the CPU engine's matvecs, for any thread count", "[host_experts]") {
  std::mt19937 rng(5);
  const ExpertLayout L = expert_layout(256, 96, 32);
  std::vector<std::vector<uint8_t>> blobs;
  for (int e = 0; e < 4; ++e) blobs.push_back(random_expert(L, rng));
  const int tokens = 3;
  std::normal_distribution<float> nd(0.f, 1.f);
  std::vector<uint16_t> x(size_t(tokens) * L.hidden);
  for (auto& v : x) v = f32_to_bf16(nd(rng));
  // Token 1 has no pair (its row stays zero); token 2 has three.
  const std::vector<HostPair> pairs = {{0, blobs[0].data(), 0.7f}, {2, blobs[1].data(), 0.2f},
                                       {2, blobs[3].data(), -0.4f}, {2, blobs[0].data(), 1.1f}};
  std::vector<float> ref(size_t(tokens) * L.hidden, 0.f);
  {
    std::vector<float> xf(size_t(L.hidden)), g(size_t(L.inter)), u(size_t(L.inter)), h(size_t(L.inter)),
        d(size_t(L.hidden));
    for (const HostPair& p : pairs) {
      for (int i = 0; i < L.hidden; ++i) xf[size_t(i)] = bf16_to_f32(x[size_t(p.token) * L.hidden + i]);
      q4_matvec(p.blob, L.gate, xf.data(), g.data());
      q4_matvec(p.blob, L.up, xf.data(), u.data());
      cpu::silu_mul(g.data(), u.data(), h.data(), L.inter);
      q4_matvec(p.blob, L.down, h.data(), d.data());
      for (int i = 0; i < L.hidden; ++i) ref[size_t(p.token) * L.hidden + i] += p.weight * d[size_t(i)];
    }
  }
  // f32 inputs: the CPU engine's own matvec, so the sums agree to rounding.
  // int8 inputs: each matvec's inputs move by up to half a step of 1/127 of
  // their block's max, about 0.6 % of a unit input each; through gate/up,
  // the SiLU product (heavy-tailed: coarse steps) and down that is ~1-2 % of
  // the largest output at worst over these 768.
  for (const bool int8 : {false, true})
  for (int threads : {1, 4}) {
    INFO("threads " << threads << " int8 inputs " << int8);
    HostExperts hx(L, threads, int8);
    std::vector<float> y(ref.size(), 123.f);
    hx.run(x.data(), tokens, pairs, y.data());
    double err = 0, norm = 0;
    for (size_t i = 0; i < y.size(); ++i) {
      err = std::max(err, double(std::abs(y[i] - ref[i])));
      norm = std::max(norm, double(std::abs(ref[i])));
    }
    CHECK(norm > 0.01);
    CHECK(err <= (int8 ? 3e-2 : 1e-5) * norm);
    for (int i = 0; i < L.hidden; ++i) CHECK(y[size_t(L.hidden) + i] == 0.f);
    const std::vector<const uint8_t*> some = {blobs[2].data(), blobs[3].data()};
    CHECK(hx.measure_us(some, 3) > 0);
  }
}

TEST_CASE("share rows table: the host takes the rows that balance it with the link", "[host_share]") {
  // 768 rows in steps of 64; link 50 us an expert, host 75 plus 5 once.
  // m=1: r rows cost the link 50 (1 - r/768) and the host 5 + 75 r/768:
  // r=256 gives max(33.3, 30) = 33.3, r=320 max(29.2, 36.25) -> 256.
  // m=2: r=256 gives max(66.7, 55), r=320 max(58.3, 67.5) -> 256.
  const std::vector<uint16_t> t = share_rows_table(4, 768, 64, 50, 75, 5);
  REQUIRE(t.size() == 5);
  CHECK(t[0] == 0);
  CHECK(t[1] == 256);
  CHECK(t[2] == 256);
  for (int m = 1; m <= 4; ++m) {
    // Whatever it picked beats every other multiple of 64 (and no share).
    auto cost = [&](int r) {
      const double f = r / 768.0;
      return r == 0 ? m * 50.0 : std::max(m * (1 - f) * 50, 5 + m * f * 75);
    };
    for (int r = 0; r <= 768; r += 64) CHECK(cost(t[size_t(m)]) <= cost(r) + 1e-9);
  }
  // A host far faster takes whole experts; one far slower nothing; an
  // intermediate size not a multiple of the step ends on the whole expert.
  CHECK(share_rows_table(2, 768, 64, 50, 1, 1) == std::vector<uint16_t>{0, 768, 768});
  CHECK(share_rows_table(2, 768, 64, 50, 5000, 5) == std::vector<uint16_t>{0, 0, 0});
  CHECK(share_rows_table(1, 100, 64, 50, 1, 1) == std::vector<uint16_t>{0, 100});
}

// The GPU's part played by a second thread through the same memory: posts
// each layer's pairs and states, waits for `done`, checks the sums against
// the CPU engine's matvecs. Two passes, so a stale flag of the first would
// show in the second.
TEST_CASE("host share serves posted layers in order and hands back the weighted sums", "[host_share]") {
  std::mt19937 rng(11);
  const ExpertLayout L = expert_layout(256, 96, 32);
  const int layers = 3, E = 4;
  std::vector<std::vector<uint8_t>> store;
  std::vector<const uint8_t*> blobs;
  for (int i = 0; i < layers * E; ++i) {
    store.push_back(random_expert(L, rng));
    blobs.push_back(store.back().data());
  }
  std::vector<ShareSlot> slots(static_cast<size_t>(layers));
  const size_t stride = size_t(kShareMaxTokens) * L.hidden;  // a layer's states and sums
  std::vector<uint16_t> xs(size_t(layers) * stride);
  std::vector<float> sums(size_t(layers) * stride, 0.f);
  for (ShareSlot& s : slots) s = ShareSlot{};
  const ShareMemory mem{slots.data(), xs.data(), sums.data()};
  std::normal_distribution<float> nd(0.f, 1.f);
  for (int threads : {1, 3}) {
    INFO("threads " << threads);
    HostShare share(L, layers, E, blobs, mem, threads);
    CHECK(share.measure_us(2) > 0);
    for (uint32_t pass : {1u + 10u * uint32_t(threads), 2u + 10u * uint32_t(threads)}) {
      // Layer 0: one token, one whole expert. Layer 1 gives the host
      // nothing. Layer 2: a pass of two tokens, three (expert, token) pairs,
      // the first 64 of 96 intermediate rows of each.
      struct Pair {
        int expert, token;
      };
      const std::vector<std::vector<Pair>> take = {{{2, 0}}, {}, {{0, 0}, {3, 1}, {1, 1}}};
      const int rows_of[3] = {L.inter, 0, 64};
      const int tokens_of[3] = {1, 1, 2};
      share.begin(pass);
      for (int l = 0; l < layers; ++l) {
        ShareSlot& s = slots[size_t(l)];
        const std::vector<Pair>& ex = take[size_t(l)];
        const int tokens = tokens_of[l];
        std::vector<float> w;
        for (size_t i = 0; i < ex.size(); ++i) {
          s.expert[i] = ex[i].expert;
          s.token[i] = uint8_t(ex[i].token);
          s.weight[i] = 0.3f + 0.2f * float(i);
          w.push_back(s.weight[i]);
        }
        s.count = uint32_t(ex.size());
        s.rows = uint32_t(rows_of[l]);
        s.tokens = uint32_t(tokens);
        const int rows = rows_of[l];
        uint16_t* x = xs.data() + size_t(l) * stride;
        for (int i = 0; i < tokens * L.hidden; ++i) x[i] = f32_to_bf16(nd(rng));
        std::fill(sums.begin() + l * stride, sums.begin() + (l + 1) * stride, 99.f);
        std::atomic_ref<uint32_t>(s.posted).store(pass, std::memory_order_release);
        std::atomic_ref<uint32_t> done(s.done);
        while (done.load(std::memory_order_acquire) != pass) std::this_thread::yield();
        // The GPU's wait for this layer, as share_collect would write it.
        std::atomic_ref<uint64_t>(s.waited_ns).store(uint64_t(l) * 40000 + 1000);
        if (ex.empty()) continue;  // the sum is not read then
        // The CPU engine's matvec over the rows the host took, per token.
        std::vector<float> xf(size_t(L.hidden)), g(size_t(L.inter)), u(size_t(L.inter)), h(size_t(L.inter)),
            d(size_t(L.hidden)), ref(size_t(tokens) * L.hidden, 0.f);
        for (size_t i = 0; i < ex.size(); ++i) {
          const int t = ex[i].token;
          for (int j = 0; j < L.hidden; ++j) xf[size_t(j)] = bf16_to_f32(x[size_t(t) * L.hidden + j]);
          const uint8_t* b = blobs[size_t(l) * E + size_t(ex[i].expert)];
          q4_matvec_rows(b, L.gate, xf.data(), 0, rows, g.data());
          q4_matvec_rows(b, L.up, xf.data(), 0, rows, u.data());
          cpu::silu_mul(g.data(), u.data(), h.data(), rows);
          q4_matvec_rows(b, L.down, h.data(), 0, L.hidden, d.data(), rows);
          for (int r = 0; r < L.hidden; ++r) ref[size_t(t) * L.hidden + r] += w[i] * d[size_t(r)];
        }
        for (int t = 0; t < tokens; ++t) {
          INFO("layer " << l << " token " << t);
          double err = 0, norm = 0;
          for (int r = 0; r < L.hidden; ++r) {
            const size_t i = size_t(t) * L.hidden + r;
            err = std::max(err, double(std::abs(sums[size_t(l) * stride + i] - ref[i])));
            norm = std::max(norm, double(std::abs(ref[i])));
          }
          CHECK(norm > 0.01);
          CHECK(err <= 1e-5 * norm);
        }
      }
      const ShareTimes before = share.times();
      share.end(true);
      // Layers 0 and 2 were shared: the GPU waited 1 and 81 µs for them.
      const ShareTimes after = share.times();
      CHECK(after.layers - before.layers == 2);
      CHECK(after.gpu_wait_us - before.gpu_wait_us == Approx(82.0));
      CHECK(after.stalls - before.stalls == 1);
      CHECK(after.max_wait_us == Approx(81.0));
      CHECK(after.host_us > before.host_us);
      // The distinct experts the host took rows of, per layer.
      CHECK(share.taken(0) == std::vector<int32_t>{2});
      CHECK(share.taken(1).empty());
      CHECK(share.taken(2) == std::vector<int32_t>{0, 3, 1});
      CHECK(share.taken_rows(2) == 64);
    }
    CHECK(share.experts_served() == 8);
    // A pass whose posts never come is abandoned, not waited for forever.
    share.begin(1000);
    share.end(false);
  }
}
