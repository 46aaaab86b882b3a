// The host side of the CUDA engine's miss split: the plan that balances host
// and link, and the experts computed on a thread pool against the CPU
// engine's matvec one pair at a time.
#include "gpu_worker/host_experts.h"

#include <catch2/catch.hpp>
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
