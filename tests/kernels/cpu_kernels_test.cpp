// The CPU kernels against straightforward double-precision loops, on odd
// sizes, and the properties the engine relies on (batch independence,
// seeded sampling).

#include <algorithm>
#include <atomic>
#include <catch2/catch.hpp>
#include <cmath>
#include <limits>
#include <map>
#include <cstring>
#include <random>
#include <set>
#include <tuple>
#include <vector>

#include "kernels/cpu/activation.h"
#include "kernels/cpu/attention.h"
#include "kernels/cpu/matmul.h"
#include "kernels/cpu/rmsnorm.h"
#include "kernels/cpu/rope.h"
#include "kernels/cpu/router.h"
#include "kernels/cpu/sampling.h"
#include "kernels/cpu/thread_pool.h"

using namespace moe::cpu;

static std::vector<float> random_vec(size_t n, uint32_t seed, float scale = 1.0f) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> d(-scale, scale);
  std::vector<float> v(n);
  for (auto& x : v) x = d(rng);
  return v;
}

static uint16_t to_bf16_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  u += 0x7FFF + ((u >> 16) & 1);
  return uint16_t(u >> 16);
}
static float from_bf16_bits(uint16_t b) {
  uint32_t u = uint32_t(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

TEST_CASE("matmul_f32 and matmul_bf16 match a double reference on odd sizes", "[kernels][matmul]") {
  ThreadPool pool(3);
  for (auto [tokens, in, out] : {std::tuple{1, 7, 5}, {3, 33, 17}, {67, 129, 70}, {2, 256, 4}}) {
    auto x = random_vec(size_t(tokens) * in, 1);
    auto w = random_vec(size_t(out) * in, 2);
    auto bias = random_vec(out, 3);
    std::vector<uint16_t> wb(w.size());
    for (size_t i = 0; i < w.size(); ++i) wb[i] = to_bf16_bits(w[i]);
    std::vector<float> y(size_t(tokens) * out), yb(y.size());
    matmul_f32(x.data(), w.data(), bias.data(), y.data(), tokens, in, out, &pool);
    matmul_bf16(x.data(), wb.data(), nullptr, yb.data(), tokens, in, out, &pool);
    for (int t = 0; t < tokens; ++t)
      for (int o = 0; o < out; ++o) {
        double ref = bias[o], refb = 0;
        for (int i = 0; i < in; ++i) {
          ref += double(x[t * in + i]) * w[o * in + i];
          refb += double(x[t * in + i]) * from_bf16_bits(wb[o * in + i]);
        }
        REQUIRE(std::abs(y[t * out + o] - ref) <= 1e-5 * in);
        REQUIRE(std::abs(yb[t * out + o] - refb) <= 1e-5 * in);
      }
  }
}

TEST_CASE("matmul: a token's output does not depend on the batch around it", "[kernels][matmul]") {
  ThreadPool pool(2);
  const int tokens = 9, in = 100, out = 37;
  auto x = random_vec(size_t(tokens) * in, 4);
  auto w = random_vec(size_t(out) * in, 5);
  std::vector<float> all(size_t(tokens) * out), one(out);
  matmul_f32(x.data(), w.data(), nullptr, all.data(), tokens, in, out, &pool);
  for (int t = 0; t < tokens; ++t) {
    matmul_f32(x.data() + t * in, w.data(), nullptr, one.data(), 1, in, out, nullptr);
    REQUIRE(std::memcmp(one.data(), all.data() + t * out, sizeof(float) * out) == 0);
  }
}

TEST_CASE("rmsnorm and per-head rmsnorm", "[kernels][rmsnorm]") {
  const int rows = 3, heads = 2, hd = 5, dim = heads * hd;
  auto x = random_vec(rows * dim, 6, 3.0f);
  auto w = random_vec(dim, 7);
  std::vector<float> y(x.size());
  rmsnorm(x.data(), w.data(), y.data(), rows, dim, 1e-6f);
  for (int r = 0; r < rows; ++r) {
    double ss = 0;
    for (int i = 0; i < dim; ++i) ss += double(x[r * dim + i]) * x[r * dim + i];
    const double inv = 1.0 / std::sqrt(ss / dim + 1e-6);
    for (int i = 0; i < dim; ++i)
      REQUIRE(y[r * dim + i] == Approx(w[i] * x[r * dim + i] * inv).epsilon(1e-5));
  }
  auto h = x;
  rmsnorm_heads(h.data(), dim, w.data(), rows, heads, hd, 1e-6f);
  for (int r = 0; r < rows; ++r)
    for (int hh = 0; hh < heads; ++hh) {
      double ss = 0;
      for (int i = 0; i < hd; ++i)
        ss += double(x[r * dim + hh * hd + i]) * x[r * dim + hh * hd + i];
      const double inv = 1.0 / std::sqrt(ss / hd + 1e-6);
      for (int i = 0; i < hd; ++i)
        REQUIRE(h[r * dim + hh * hd + i] ==
                Approx(w[i] * x[r * dim + hh * hd + i] * inv).epsilon(1e-5));
    }
}

TEST_CASE("rope: neox and interleaved rotate the right pairs", "[kernels][rope]") {
  const int hd = 8;
  auto inv = rope_inv_freq_default(10000.0f, hd);
  REQUIRE(inv[1] == Approx(1.0 / std::pow(10000.0, 2.0 / 8)));
  auto x = random_vec(hd, 8);
  auto a = x, b = x;
  const int32_t pos = 7;
  rope_neox(a.data(), hd, hd, &pos, 1, 1, hd, inv.data());
  rope_interleaved(b.data(), hd, hd, &pos, 1, 1, hd, inv.data());
  for (int i = 0; i < hd / 2; ++i) {
    const double c = std::cos(pos * double(inv[i])), s = std::sin(pos * double(inv[i]));
    REQUIRE(a[i] == Approx(x[i] * c - x[i + hd / 2] * s).margin(1e-5));
    REQUIRE(a[i + hd / 2] == Approx(x[i + hd / 2] * c + x[i] * s).margin(1e-5));
    REQUIRE(b[2 * i] == Approx(x[2 * i] * c - x[2 * i + 1] * s).margin(1e-5));
    REQUIRE(b[2 * i + 1] == Approx(x[2 * i + 1] * c + x[2 * i] * s).margin(1e-5));
  }
  // Rotation keeps relative positions: q(p).k(p') depends only on p - p'.
  auto q = random_vec(hd, 9), k = random_vec(hd, 10);
  auto dot_at = [&](int32_t pq, int32_t pk) {
    auto qq = q, kk = k;
    rope_neox(qq.data(), hd, hd, &pq, 1, 1, hd, inv.data());
    rope_neox(kk.data(), hd, hd, &pk, 1, 1, hd, inv.data());
    double d = 0;
    for (int i = 0; i < hd; ++i) d += double(qq[i]) * kk[i];
    return d;
  };
  REQUIRE(dot_at(10, 3) == Approx(dot_at(27, 20)).margin(1e-4));
}

TEST_CASE("yarn frequencies: factor 1 leaves the default table", "[kernels][rope]") {
  float af = 0;
  auto y = rope_inv_freq_yarn(10000.0f, 16, 1.0f, 4096, 32.0f, 1.0f, 1.0f, 0.0f, &af);
  auto d = rope_inv_freq_default(10000.0f, 16);
  REQUIRE(af == 1.0f);
  for (size_t i = 0; i < d.size(); ++i) REQUIRE(y[i] == Approx(d[i]).epsilon(1e-6));
  auto y4 = rope_inv_freq_yarn(10000.0f, 16, 4.0f, 4096, 32.0f, 1.0f, 1.0f, 0.0f, &af);
  REQUIRE(y4[0] == Approx(d[0]).epsilon(1e-6));              // fast dims extrapolate
  REQUIRE(y4.back() == Approx(d.back() / 4).epsilon(1e-6));  // slow dims interpolate
  REQUIRE(af == Approx(0.1 * std::log(4.0) + 1.0));
}

TEST_CASE("paged attention equals contiguous causal GQA", "[kernels][attention]") {
  ThreadPool pool(2);
  const int ctx = 11, n_heads = 4, n_kv = 2, dk = 6, dv = 5, bt = 4;
  auto q = random_vec(ctx * n_heads * dk, 11), k = random_vec(ctx * n_kv * dk, 12),
       v = random_vec(ctx * n_kv * dv, 13);
  // Blocks deliberately out of order in a larger pool.
  std::vector<int32_t> table = {5, 1, 3};
  std::vector<float> kp(6 * bt * n_kv * dk, NAN), vp(6 * bt * n_kv * dv, NAN);
  for (int p = 0; p < ctx; ++p)
    kv_store(kp.data(), vp.data(), table.data(), bt, p, &k[p * n_kv * dk], &v[p * n_kv * dv], n_kv,
             dk, dv);
  std::vector<int32_t> pos(ctx);
  for (int i = 0; i < ctx; ++i) pos[i] = i;
  std::vector<float> out(ctx * n_heads * dv);
  PagedKv kv{kp.data(), vp.data(), table.data(), bt};
  const float scale = 0.37f;
  attention(q.data(), n_heads * dk, kv, pos.data(), out.data(), n_heads * dv, ctx, n_heads, n_kv,
            dk, dv, scale, &pool);
  for (int t = 0; t < ctx; ++t)
    for (int h = 0; h < n_heads; ++h) {
      const int g = h / (n_heads / n_kv);
      std::vector<double> s(t + 1);
      double mx = -1e30, sum = 0;
      for (int j = 0; j <= t; ++j) {
        double d = 0;
        for (int i = 0; i < dk; ++i)
          d += double(q[(t * n_heads + h) * dk + i]) * k[(j * n_kv + g) * dk + i];
        s[j] = d * scale;
        mx = std::max(mx, s[j]);
      }
      for (auto& e : s) sum += (e = std::exp(e - mx));
      for (int i = 0; i < dv; ++i) {
        double o = 0;
        for (int j = 0; j <= t; ++j) o += s[j] / sum * v[(j * n_kv + g) * dv + i];
        REQUIRE(out[(t * n_heads + h) * dv + i] == Approx(o).margin(1e-5));
      }
    }
}

TEST_CASE("e4m3 codes: every finite code decodes and encodes back; ties go to even; past 448 saturates",
          "[kernels][kv]") {
  using moe::e4m3_decode;
  using moe::e4m3_encode;
  int finite = 0;
  for (int c = 0; c < 256; ++c) {
    const float x = e4m3_decode(uint8_t(c));
    if (std::isnan(x)) {
      CHECK((c & 0x7f) == 0x7f);
      continue;
    }
    ++finite;
    if (c == 0x80) CHECK(e4m3_encode(x) == 0x80);  // -0
    else CHECK(e4m3_encode(x) == uint8_t(c));
  }
  CHECK(finite == 254);
  CHECK(e4m3_decode(0x7e) == 448.0f);
  CHECK(e4m3_decode(0x01) == std::ldexp(1.0f, -9));  // the least subnormal
  CHECK(e4m3_decode(0x08) == std::ldexp(1.0f, -6));  // the least normal
  // Between two codes: the nearer; half-way: the even mantissa.
  CHECK(e4m3_encode(1.0625f) == e4m3_encode(1.0f));     // 1 + 1/16: tie, 1.0 (mantissa 0) is even
  CHECK(e4m3_encode(1.1875f) == e4m3_encode(1.25f));    // 1 + 3/16: tie, 1.25 (mantissa 2) is even
  CHECK(e4m3_encode(1.1f) == e4m3_encode(1.125f));
  CHECK(e4m3_encode(15.5f) == e4m3_encode(16.0f));      // rounds up into the next binade
  CHECK(e4m3_encode(3 * std::ldexp(1.0f, -10)) == 0x02);  // 1.5 subnormal steps: tie, 2 is even
  CHECK(e4m3_encode(1000.0f) == 0x7e);
  CHECK(e4m3_encode(-1000.0f) == 0xfe);
  CHECK(e4m3_encode(std::ldexp(1.0f, -11)) == 0x00);   // a quarter step: zero
}

TEST_CASE("a coded KV row: the scale maps max |x| to the largest code, each value within half a step",
          "[kernels][kv]") {
  for (moe::KvDtype d : {moe::KvDtype::int8, moe::KvDtype::fp8}) {
    auto x = random_vec(128, 21, 3.0f);
    x[17] = -5.5f;  // the row's max |x|
    std::vector<uint8_t> codes(128);
    const float scale = moe::kv_encode_row(d, x.data(), 128, codes.data());
    CHECK(scale == Approx(5.5f / moe::kv_code_max(d)));
    const auto& table = moe::kv_code_table(d);
    CHECK(table[codes[17]] * scale == Approx(-5.5f));
    for (int i = 0; i < 128; ++i) {
      const float y = table[codes[size_t(i)]] * scale;
      if (d == moe::KvDtype::int8) CHECK(std::fabs(y - x[size_t(i)]) <= 0.5f * scale * 1.0001f);
      else CHECK(std::fabs(y - x[size_t(i)]) <= std::max(std::fabs(x[size_t(i)]) / 16.0f, std::ldexp(scale, -10)) * 1.0001f);
    }
    std::vector<float> zero(64, 0.0f);
    std::vector<uint8_t> zc(64, 0xaa);
    CHECK(moe::kv_encode_row(d, zero.data(), 64, zc.data()) == 0.0f);
    for (uint8_t c : zc) CHECK(table[c] == 0.0f);
    // A row so small that code max / max|x| is no longer finite: zeros, not NaN.
    zero[0] = 2e-37f;
    CHECK(moe::kv_encode_row(d, zero.data(), 64, zc.data()) == 0.0f);
    for (uint8_t c : zc) CHECK(table[c] == 0.0f);
  }
}

TEST_CASE("paged attention over coded rows equals attention over the rows the codes stand for",
          "[kernels][attention][kv]") {
  ThreadPool pool(2);
  const int ctx = 23, n_heads = 4, n_kv = 2, dk = 24, dv = 16, bt = 4, pool_blocks = 8;
  auto q = random_vec(ctx * n_heads * dk, 31), k = random_vec(ctx * n_kv * dk, 32, 2.0f),
       v = random_vec(ctx * n_kv * dv, 33, 0.5f);
  std::vector<int32_t> table = {6, 1, 3, 0, 7, 2};
  std::vector<int32_t> pos(ctx);
  for (int i = 0; i < ctx; ++i) pos[i] = i;
  for (moe::KvDtype d : {moe::KvDtype::int8, moe::KvDtype::fp8}) {
    const size_t rows = size_t(pool_blocks) * bt * n_kv;
    std::vector<uint8_t> kc(rows * dk), vc(rows * dv);
    std::vector<float> ks(rows, NAN), vs(rows, NAN);
    KvRows pr;
    pr.dtype = d;
    pr.k_codes = kc.data();
    pr.v_codes = vc.data();
    pr.k_scales = ks.data();
    pr.v_scales = vs.data();
    for (int p = 0; p < ctx; ++p)
      kv_store(pr, table.data(), bt, p, &k[p * n_kv * dk], &v[p * n_kv * dv], n_kv, dk, dv);
    // The f32 rows the codes stand for, in a plain pool.
    std::vector<float> kp(rows * dk), vp(rows * dv);
    const auto& tab = moe::kv_code_table(d);
    for (size_t r = 0; r < rows; ++r) {
      if (std::isnan(ks[r])) continue;
      for (int i = 0; i < dk; ++i) kp[r * dk + i] = tab[kc[r * dk + i]] * ks[r];
      for (int i = 0; i < dv; ++i) vp[r * dv + i] = tab[vc[r * dv + i]] * vs[r];
    }
    std::vector<float> out(ctx * n_heads * dv), ref(ctx * n_heads * dv), exact(ctx * n_heads * dv);
    PagedKv coded{nullptr, nullptr, table.data(), bt, d, kc.data(), vc.data(), ks.data(), vs.data()};
    PagedKv plain{kp.data(), vp.data(), table.data(), bt};
    attention(q.data(), n_heads * dk, coded, pos.data(), out.data(), n_heads * dv, ctx, n_heads, n_kv, dk, dv,
              0.2f, &pool);
    attention(q.data(), n_heads * dk, plain, pos.data(), ref.data(), n_heads * dv, ctx, n_heads, n_kv, dk, dv,
              0.2f, &pool);
    // And over the unquantised rows: what the codes cost.
    std::vector<float> kx(rows * dk), vx(rows * dv);
    for (int p = 0; p < ctx; ++p)
      kv_store(kx.data(), vx.data(), table.data(), bt, p, &k[p * n_kv * dk], &v[p * n_kv * dv], n_kv, dk, dv);
    PagedKv full{kx.data(), vx.data(), table.data(), bt};
    attention(q.data(), n_heads * dk, full, pos.data(), exact.data(), n_heads * dv, ctx, n_heads, n_kv, dk, dv,
              0.2f, &pool);
    double worst = 0;
    for (size_t i = 0; i < out.size(); ++i) {
      REQUIRE(out[i] == Approx(ref[i]).margin(1e-5));
      worst = std::max(worst, double(std::fabs(out[i] - exact[i])));
    }
    INFO("the codes move an output by at most " << worst);
    CHECK(worst < (d == moe::KvDtype::int8 ? 0.01 : 0.03));
    CHECK(worst > 0);
  }
}

TEST_CASE("router: softmax then top-k, renormalised or not, scaled, group-limited",
          "[kernels][router]") {
  const std::vector<float> logits = {0.1f, 2.0f, -1.0f, 1.5f, 1.5f, 0.0f};
  std::vector<double> p(6);
  double z = 0;
  for (int i = 0; i < 6; ++i) z += (p[i] = std::exp(double(logits[i])));
  for (auto& e : p) e /= z;
  int32_t ids[3];
  float w[3];
  RouterParams rp{6, 3, false, 1.0f, 1, 1};
  router_topk(logits.data(), 1, rp, ids, w);
  REQUIRE(ids[0] == 1);
  REQUIRE(ids[1] == 3);  // equal scores: lower index first
  REQUIRE(ids[2] == 4);
  REQUIRE(w[0] == Approx(p[1]));
  rp.renormalize = true;
  rp.scale = 2.0f;
  router_topk(logits.data(), 1, rp, ids, w);
  REQUIRE(w[0] + w[1] + w[2] == Approx(2.0));
  REQUIRE(w[0] == Approx(2 * p[1] / (p[1] + p[3] + p[4])));
  // Groups {0,1,2} {3,4,5}: with one group allowed, only the group of the best expert.
  RouterParams g{6, 2, false, 1.0f, 2, 1};
  router_topk(logits.data(), 1, g, ids, w);
  REQUIRE(ids[0] == 1);
  REQUIRE(ids[1] == 0);
}

TEST_CASE("silu_mul", "[kernels][activation]") {
  const float g[3] = {-2.0f, 0.0f, 3.0f}, u[3] = {1.5f, 2.0f, -0.5f};
  float o[3];
  silu_mul(g, u, o, 3);
  for (int i = 0; i < 3; ++i) REQUIRE(o[i] == Approx(g[i] / (1 + std::exp(-double(g[i]))) * u[i]));
}

TEST_CASE("sampling: greedy, seeded determinism, top-k and top-p limits", "[kernels][sampling]") {
  const int vocab = 50;
  auto logits = random_vec(vocab, 14, 3.0f);
  int best = 0;
  for (int i = 1; i < vocab; ++i)
    if (logits[i] > logits[best]) best = i;
  REQUIRE(sample_token(logits.data(), vocab, {0.0f, 1.0f, 0, 1}, 0) == best);
  REQUIRE(sample_token(logits.data(), vocab, {1.0f, 1.0f, 1, 1}, 0) == best);

  // Same (seed, position): same token; across positions the draws vary.
  moe::SampleDraw p{1.0f, 1.0f, 0, 42};
  std::set<int> seen;
  for (int pos = 0; pos < 200; ++pos) {
    const int a = sample_token(logits.data(), vocab, p, pos);
    REQUIRE(a == sample_token(logits.data(), vocab, p, pos));
    seen.insert(a);
  }
  REQUIRE(seen.size() > 3);

  // top_k = 3 only ever yields the three best tokens.
  std::vector<int> order(vocab);
  for (int i = 0; i < vocab; ++i) order[i] = i;
  std::sort(order.begin(), order.end(), [&](int a, int b) { return logits[a] > logits[b]; });
  for (int pos = 0; pos < 200; ++pos) {
    const int t = sample_token(logits.data(), vocab, {2.0f, 1.0f, 3, 7}, pos);
    REQUIRE((t == order[0] || t == order[1] || t == order[2]));
  }
  // A tiny top_p keeps only the best token.
  for (int pos = 0; pos < 50; ++pos)
    REQUIRE(sample_token(logits.data(), vocab, {1.0f, 1e-6f, 0, 7}, pos) == best);

  // Sampling frequencies follow the softmax.
  const float two[2] = {0.0f, std::log(3.0f)};  // p = 1/4, 3/4
  int ones = 0;
  for (int pos = 0; pos < 4000; ++pos) ones += sample_token(two, 2, {1.0f, 1.0f, 0, 3}, pos);
  REQUIRE(ones / 4000.0 == Approx(0.75).margin(0.03));

  REQUIRE(token_logprob(two, 2, 1) == Approx(std::log(0.75)));
  auto top = top_logprobs(two, 2, 1);
  REQUIRE(top.size() == 1);
  REQUIRE(top[0].first == 1);
}

// The penalties as their sources define them, from the token lists, not from
// an adjustment list: transformers' repetition penalty over prompt and
// output, OpenAI's presence/frequency penalties over the output only.
static std::vector<float> penalised_reference(std::vector<float> logits, const std::vector<int32_t>& prompt,
                                              const std::vector<int32_t>& output, float repetition, float presence,
                                              float frequency, const std::map<int32_t, float>& bias) {
  std::set<int32_t> seen(prompt.begin(), prompt.end());
  seen.insert(output.begin(), output.end());
  for (int32_t t : seen) {
    float& l = logits[size_t(t)];
    l = l < 0 ? l * repetition : l / repetition;
  }
  std::map<int32_t, int> count;
  for (int32_t t : output) ++count[t];
  for (auto [t, c] : count) logits[size_t(t)] -= frequency * float(c) + presence;
  for (auto [t, b] : bias) logits[size_t(t)] += b;
  return logits;
}

TEST_CASE("token adjustments: penalties and biases as their definitions give them", "[kernels][sampling]") {
  const int vocab = 300;
  std::mt19937 rng(5);
  std::uniform_int_distribution<int32_t> tok(0, vocab - 1);
  for (int round = 0; round < 20; ++round) {
    INFO("round " << round);
    const auto logits = random_vec(vocab, 100 + round, 4.0f);
    std::vector<int32_t> prompt(40), output(25);
    for (auto& t : prompt) t = tok(rng);
    for (auto& t : output) t = tok(rng) % 60;  // repeats
    std::map<int32_t, float> bias{{tok(rng), 5.0f}, {tok(rng), -100.0f}, {output[0], 1.5f}};
    const float rep = round % 3 == 0 ? 1.0f : 1.1f + 0.05f * float(round);
    const float presence = 0.1f * float(round % 5), frequency = -0.3f + 0.07f * float(round);
    const auto want = penalised_reference(logits, prompt, output, rep, presence, frequency, bias);

    // The list the gateway would send: every distinct token of prompt,
    // output and bias, sorted.
    std::map<int32_t, moe::TokenAdjust> list;
    for (int32_t t : prompt) list[t].in_prompt = 1;
    for (int32_t t : output) ++list[t].output_count;
    for (auto [t, b] : bias) list[t].bias = b;
    std::vector<moe::TokenAdjust> adjust;
    for (auto& [t, a] : list) {
      a.token = t;
      adjust.push_back(a);
    }
    auto got = logits;
    adjust_logits(got.data(), vocab, adjust, {rep, presence, frequency});
    for (int i = 0; i < vocab; ++i) REQUIRE(got[size_t(i)] == Approx(want[size_t(i)]).margin(1e-5));
  }
  // -inf bans a token from greedy and from every draw.
  auto logits = random_vec(vocab, 7, 3.0f);
  const int best = int(std::max_element(logits.begin(), logits.end()) - logits.begin());
  std::vector<moe::TokenAdjust> ban{{best, -std::numeric_limits<float>::infinity(), 0, 0}};
  adjust_logits(logits.data(), vocab, ban, {});
  REQUIRE(sample_token(logits.data(), vocab, {0.0f, 1.0f, 0, 1}, 0) != best);
  for (int pos = 0; pos < 500; ++pos) REQUIRE(sample_token(logits.data(), vocab, {1.5f, 1.0f, 0, 9}, pos) != best);
}

TEST_CASE("a mask of allowed tokens: only they are drawn, in their own proportions", "[kernels][sampling]") {
  const int vocab = 70;
  auto logits = random_vec(vocab, 21, 2.0f);
  std::vector<uint32_t> mask(3, 0u);
  const std::set<int> allowed{3, 33, 64, 69};
  for (int t : allowed) mask[size_t(t) / 32] |= 1u << (t % 32);
  auto masked = logits;
  mask_logits(masked.data(), vocab, mask.data());
  double total = 0;
  for (int t : allowed) total += std::exp(double(logits[size_t(t)]));
  std::map<int, int> count;
  const int n = 20000;
  for (int pos = 0; pos < n; ++pos) ++count[sample_token(masked.data(), vocab, {1.0f, 1.0f, 0, 5}, pos)];
  for (auto [t, c] : count) {
    REQUIRE(allowed.count(t));
    REQUIRE(double(c) / n == Approx(std::exp(double(logits[size_t(t)])) / total).margin(0.015));
  }
  int best = *allowed.begin();
  for (int t : allowed)
    if (logits[size_t(t)] > logits[size_t(best)]) best = t;
  REQUIRE(sample_token(masked.data(), vocab, {0.0f, 1.0f, 0, 1}, 0) == best);
  REQUIRE(allowed.count(sample_token(masked.data(), vocab, {1.0f, 0.9f, 40, 2}, 3)));
  // A logit pushed to infinity (a penalty's division overflowed) left every
  // weight NaN and the draw fell back to token 0, masked or not: the
  // infinite allowed token is drawn, as greedy.
  auto overflowed = masked;
  overflowed[33] = std::numeric_limits<float>::infinity();
  overflowed[0] = std::numeric_limits<float>::infinity();  // masked out below
  mask_logits(overflowed.data(), vocab, mask.data());
  for (int pos = 0; pos < 50; ++pos) {
    REQUIRE(sample_token(overflowed.data(), vocab, {1.0f, 1.0f, 0, 5}, pos) == 33);
    REQUIRE(sample_token(overflowed.data(), vocab, {0.7f, 0.9f, 10, 5}, pos) == 33);
  }
}

TEST_CASE("min_p keeps tokens at or above min_p times the best one's probability", "[kernels][sampling]") {
  // p = 0.5, 0.3, 0.15, 0.05 at temperature 1.
  const float l[4] = {std::log(0.5f), std::log(0.3f), std::log(0.15f), std::log(0.05f)};
  for (float min_p : {0.0f, 0.2f, 0.5f, 1.0f}) {
    INFO("min_p " << min_p);
    moe::SampleDraw p{1.0f, 1.0f, 0, 11};
    p.min_p = min_p;
    double kept_mass = 0;
    auto kept = [&](int i) { return std::exp(double(l[i]) - double(l[0])) >= double(min_p); };
    for (int i = 0; i < 4; ++i)
      if (kept(i)) kept_mass += std::exp(double(l[i]));
    int count[4] = {0, 0, 0, 0};
    const int n = 20000;
    for (int pos = 0; pos < n; ++pos) ++count[sample_token(l, 4, p, pos)];
    for (int i = 0; i < 4; ++i) {
      const double want = kept(i) ? std::exp(double(l[i])) / kept_mass : 0.0;
      REQUIRE(double(count[i]) / n == Approx(want).margin(0.012));
      if (!kept(i)) REQUIRE(count[i] == 0);
    }
  }
  // After temperature: at T = 2 the cut is on the flattened probabilities.
  moe::SampleDraw p{2.0f, 1.0f, 0, 3};
  p.min_p = 0.5f;  // kept: exp((l - l_max) / 2) >= 0.5, i.e. p_i / p_max >= 0.25: tokens 0, 1 and 2
  std::set<int> seen;
  for (int pos = 0; pos < 3000; ++pos) seen.insert(sample_token(l, 4, p, pos));
  REQUIRE(seen == std::set<int>{0, 1, 2});
}

TEST_CASE("thread pool runs every index once", "[kernels][threads]") {
  ThreadPool pool(4);
  for (int round = 0; round < 50; ++round) {
    std::vector<std::atomic<int>> hits(97);
    pool.parallel_for(97, [&](int64_t i) { hits[i]++; });
    for (auto& h : hits) REQUIRE(h.load() == 1);
  }
}
