// INT4 experts (docs/int4-experts.md): group sizes, the blob layout, the
// quantisation error bound on odd shapes, constant groups, and q4_matvec
// against dequantise-then-dot.

#include <time.h>

#include <catch2/catch.hpp>
#include <chrono>
#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "model/int4.h"
#include "model/safetensors.h"

using namespace moe;

namespace {

std::vector<float> random_matrix(int rows, int cols, uint32_t seed, float offset = 0.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, 0.05f);
  std::vector<float> w(size_t(rows) * size_t(cols));
  for (auto& v : w)
    v = bf16_to_f32(f32_to_bf16(dist(rng) + offset));  // checkpoint weights are bf16
  return w;
}

void read_params(const uint8_t* blob, const Q4MatrixLayout& m, int row, int g, float* scale,
                 float* bias) {
  uint16_t h[2];
  std::memcpy(h, blob + m.params_offset + (size_t(row) * size_t(m.cols / m.group) + size_t(g)) * 4,
              4);
  *scale = f16_to_f32(h[0]);
  *bias = f16_to_f32(h[1]);
}

// Checks every weight against the bound of docs/int4-experts.md:
// |w - w'| <= scale/2 + the half rounding of the bias (<= |bias| * 2^-11).
void check_round_trip(const std::vector<float>& w, const Q4MatrixLayout& m, const uint8_t* blob) {
  std::vector<float> row(static_cast<size_t>(m.cols));
  for (int r = 0; r < m.rows; ++r) {
    q4_dequantize_row(blob, m, r, row.data());
    for (int c = 0; c < m.cols; ++c) {
      float scale, bias;
      read_params(blob, m, r, c / m.group, &scale, &bias);
      const float want = w[size_t(r) * size_t(m.cols) + size_t(c)];
      const float bound = scale / 2 + std::fabs(bias) * 0x1p-11f + 1e-7f * std::fabs(want);
      if (std::fabs(row[size_t(c)] - want) > bound) {
        FAIL("row " << r << " col " << c << " w " << want << " got " << row[size_t(c)] << " scale "
                    << scale);
      }
    }
  }
}

}  // namespace

TEST_CASE("effective group: the largest power of two <= G that divides K", "[int4]") {
  CHECK(q4_effective_group(64, 64) == 64);
  CHECK(q4_effective_group(2048, 128) == 128);
  CHECK(q4_effective_group(96, 64) == 32);  // Mixtral-like K
  CHECK(q4_effective_group(96, 128) == 32);
  CHECK(q4_effective_group(32, 64) == 32);
  CHECK(q4_effective_group(48, 64) == 16);
  CHECK(q4_effective_group(1408, 128) == 128);
  CHECK(q4_effective_group(6, 64) == 2);
  CHECK(q4_effective_group(64, 100) == 64);  // a non-power-of-two request rounds down
}

TEST_CASE("expert layout: regions in order, 256-byte aligned, disjoint", "[int4]") {
  for (auto [h, i, g] :
       {std::tuple{64, 96, 64}, {64, 32, 64}, {256, 128, 32}, {2048, 768, 128}, {64, 96, 128}}) {
    INFO("H " << h << " I " << i << " G " << g);
    const ExpertLayout e = expert_layout(h, i, g);
    CHECK(e.hidden == h);
    CHECK(e.inter == i);
    CHECK(e.group == g);
    CHECK(e.gate.rows == i);
    CHECK(e.gate.cols == h);
    CHECK(e.up.rows == i);
    CHECK(e.down.rows == h);
    CHECK(e.down.cols == i);
    CHECK(e.gate.group == q4_effective_group(h, g));
    CHECK(e.down.group == q4_effective_group(i, g));
    const Q4MatrixLayout* ms[] = {&e.gate, &e.up, &e.down};
    size_t end = 0;
    for (const Q4MatrixLayout* m : ms) {
      CHECK(m->codes_offset % kQ4Align == 0);
      CHECK(m->params_offset % kQ4Align == 0);
      CHECK(m->codes_offset >= end);
      CHECK(m->params_offset >= m->codes_offset + m->codes_bytes());
      CHECK(m->params_offset - (m->codes_offset + m->codes_bytes()) <
            kQ4Align);  // no more padding than needed
      end = m->params_offset + m->params_bytes();
    }
    CHECK(e.gate.codes_offset == 0);
    CHECK(e.blob_bytes % kQ4Align == 0);
    CHECK(e.blob_bytes >= end);
    CHECK(e.blob_bytes - end < kQ4Align);
  }
  // A worked example: H = 64, I = 96, G = 64 (down uses groups of 32).
  const ExpertLayout e = expert_layout(64, 96, 64);
  CHECK(e.gate.codes_bytes() == 96 * 32);
  CHECK(e.gate.params_bytes() == 96 * 1 * 4);
  CHECK(e.up.codes_offset == 3072 + 512);
  CHECK(e.down.group == 32);
  CHECK(e.down.params_bytes() == 64 * 3 * 4);
}

TEST_CASE("a matrix of its own: codes at 0, params on the next boundary; row slices quantise as the whole",
          "[int4]") {
  for (auto [n, k, g] : {std::tuple{37, 160, 64}, {8, 2048, 64}, {5, 96, 64}}) {
    INFO("rows " << n << " cols " << k);
    const Q4MatrixLayout m = q4_matrix_layout(n, k, g);
    CHECK(m.group == q4_effective_group(k, g));
    CHECK(m.codes_offset == 0);
    CHECK(m.params_offset % kQ4Align == 0);
    CHECK(m.params_offset >= m.codes_bytes());
    CHECK(m.params_offset < m.codes_bytes() + kQ4Align);
    CHECK(q4_matrix_bytes(m) == m.params_offset + m.params_bytes());
    const auto w = random_matrix(n, k, 7);
    std::vector<uint8_t> whole(q4_matrix_bytes(m)), parts(q4_matrix_bytes(m));
    q4_quantize_matrix(w.data(), m, whole.data());
    // Three slices, each quantised from its own rows only.
    const int cuts[] = {0, 1, n / 2, n};
    for (int i = 0; i + 1 < 4; ++i) {
      const Q4MatrixLayout s = q4_row_slice(m, cuts[i], cuts[i + 1] - cuts[i]);
      CHECK(s.rows == cuts[i + 1] - cuts[i]);
      q4_quantize_matrix(w.data() + size_t(cuts[i]) * k, s, parts.data());
    }
    CHECK(parts == whole);
    // A slice reads the same rows as the whole.
    const Q4MatrixLayout s = q4_row_slice(m, n - 2, 2);
    std::vector<float> a(static_cast<size_t>(k)), b(static_cast<size_t>(k));
    q4_dequantize_row(whole.data(), m, n - 1, a.data());
    q4_dequantize_row(whole.data(), s, 1, b.data());
    CHECK(a == b);
  }
}

TEST_CASE("round trip error stays within scale/2 on odd shapes", "[int4]") {
  uint32_t seed = 1;
  for (int k : {64, 96, 32})
    for (int n : {1, 7, 33})
      for (int g : {32, 64, 128})
        for (float offset :
             {0.0f, 0.2f, -0.3f}) {  // offsets give one-signed groups (zero point at an end)
          INFO("K " << k << " N " << n << " G " << g << " offset " << offset);
          const Q4MatrixLayout m = q4_matrix_layout(n, k, g);
          const auto w = random_matrix(n, k, seed++, offset);
          std::vector<uint8_t> blob(m.params_offset + m.params_bytes(), 0xAB);
          q4_quantize_matrix(w.data(), m, blob.data());
          check_round_trip(w, m, blob.data());
        }
}

TEST_CASE("round trip bound holds for tiny (subnormal-half scale) and large weights", "[int4]") {
  for (float magnitude : {1e-5f, 3e-4f, 40.0f}) {
    INFO("magnitude " << magnitude);
    const Q4MatrixLayout m = q4_matrix_layout(5, 96, 64);
    auto w = random_matrix(5, 96, 11);
    for (auto& v : w) v = bf16_to_f32(f32_to_bf16(v * magnitude / 0.05f));
    std::vector<uint8_t> blob(m.params_offset + m.params_bytes());
    q4_quantize_matrix(w.data(), m, blob.data());
    check_round_trip(w, m, blob.data());
  }
}

TEST_CASE("the round trip error is what 4 bits give, not merely bounded", "[int4]") {
  // Uniform-ish weights: the mean error of nearest rounding is about scale/4.
  const Q4MatrixLayout m = q4_matrix_layout(64, 128, 64);
  const auto w = random_matrix(64, 128, 99);
  std::vector<uint8_t> blob(m.params_offset + m.params_bytes());
  q4_quantize_matrix(w.data(), m, blob.data());
  double err = 0, scale_sum = 0;
  std::vector<float> row(128);
  for (int r = 0; r < 64; ++r) {
    q4_dequantize_row(blob.data(), m, r, row.data());
    for (int c = 0; c < 128; ++c) {
      float s, b;
      read_params(blob.data(), m, r, c / 64, &s, &b);
      err += std::fabs(row[size_t(c)] - w[size_t(r) * 128 + size_t(c)]);
      scale_sum += s;
    }
  }
  CHECK(err / scale_sum > 0.15);
  CHECK(err / scale_sum < 0.35);
}

TEST_CASE("constant groups dequantise to their value exactly", "[int4]") {
  const int k = 96, n = 3;
  const Q4MatrixLayout m = q4_matrix_layout(n, k, 32);
  auto w = random_matrix(n, k, 7);
  // Row 0: three constant groups (zero, positive, negative); row 1: one.
  for (int c = 0; c < 32; ++c) {
    w[size_t(c)] = 0.0f;
    w[size_t(32 + c)] = 0.375f;
    w[size_t(64 + c)] = bf16_to_f32(f32_to_bf16(-1.2345f));
    w[size_t(k + 32 + c)] = bf16_to_f32(f32_to_bf16(3.0e-3f));
  }
  std::vector<uint8_t> blob(m.params_offset + m.params_bytes());
  q4_quantize_matrix(w.data(), m, blob.data());
  std::vector<float> row(static_cast<size_t>(k));
  q4_dequantize_row(blob.data(), m, 0, row.data());
  for (int c = 0; c < k; ++c) REQUIRE(row[size_t(c)] == w[size_t(c)]);
  q4_dequantize_row(blob.data(), m, 1, row.data());
  for (int c = 32; c < 64; ++c) REQUIRE(row[size_t(c)] == w[size_t(k + c)]);
  check_round_trip(w, m, blob.data());
}

namespace {

// A random n x k matrix quantised with group g, and a random input.
struct MatvecCase {
  Q4MatrixLayout m;
  std::vector<float> x;
  std::vector<uint8_t> blob;
};

MatvecCase matvec_case(int n, int k, int g, uint32_t& seed) {
  MatvecCase c;
  c.m = q4_matrix_layout(n, k, g);
  const auto w = random_matrix(n, k, seed++);
  c.x.resize(static_cast<size_t>(k));
  std::mt19937 rng(seed++);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  for (auto& v : c.x) v = dist(rng);
  c.blob.resize(c.m.params_offset + c.m.params_bytes());
  q4_quantize_matrix(w.data(), c.m, c.blob.data());
  return c;
}

}  // namespace

TEST_CASE("q4_matvec equals dequantise-then-dot", "[int4]") {
  uint32_t seed = 100;
  // Widths of real matrices too (a Qwen3-30B expert's 768 and 2,048): every
  // SIMD path this CPU takes runs whole groups and many chunks of them.
  for (int k : {64, 96, 32, 6, 768, 2048})
    for (int n : {1, 7, 33})
      for (int g : {32, 64, 128}) {
        INFO("K " << k << " N " << n << " G " << g);
        const MatvecCase mc = matvec_case(n, k, g, seed);
        const Q4MatrixLayout& m = mc.m;
        const std::vector<float>& x = mc.x;
        const std::vector<uint8_t>& blob = mc.blob;
        std::vector<float> y(static_cast<size_t>(n));
        std::vector<float> row(static_cast<size_t>(k));
        // Rows [r0, n) of y against the dequantised rows over inputs [0, cols).
        auto check_rows = [&](int r0, int cols) {
          for (int r = r0; r < n; ++r) {
            q4_dequantize_row(blob.data(), m, r, row.data());
            double want = 0, mag = 0;
            for (int c = 0; c < cols; ++c) {
              want += double(row[size_t(c)]) * x[size_t(c)];
              mag += std::fabs(double(row[size_t(c)]) * x[size_t(c)]);
            }
            REQUIRE(std::fabs(y[size_t(r)] - want) <= 1e-5 * mag + 1e-7);
          }
        };
        q4_matvec(blob.data(), m, x.data(), y.data());
        check_rows(0, k);
        // Rows 1.. over the first half of the inputs (whole groups) only.
        const int half = (k / 2) / m.group * m.group;
        if (half == 0 || n < 2) continue;
        q4_matvec_rows(blob.data(), m, x.data(), 1, n, y.data(), half);
        check_rows(1, half);
        // With the group sums given: the same numbers.
        std::vector<float> sums(size_t(k / m.group)), y2(static_cast<size_t>(n));
        q4_group_sums(m, x.data(), half, sums.data());
        q4_matvec_rows_summed(blob.data(), m, x.data(), sums.data(), 1, n, y2.data(), half);
        for (int r = 1; r < n; ++r) REQUIRE(y2[size_t(r)] == y[size_t(r)]);
      }
}

TEST_CASE("q4_matvec_rows_q8 agrees with q4_matvec within int8 input rounding, row slices included", "[int4]") {
  uint32_t seed = 300;
  // K 6 and 48 take the portable loop (groups of 2 and 16); the rest AVX2,
  // with int8 blocks of 32 inside groups of 32 to 128.
  for (int k : {256, 96, 6, 48})
    for (int g : {32, 64, 128}) {
      const int n = 19;
      INFO("K " << k << " G " << g);
      const MatvecCase mc = matvec_case(n, k, g, seed);
      const Q4MatrixLayout& m = mc.m;
      const std::vector<float>& x = mc.x;
      const std::vector<uint8_t>& blob = mc.blob;
      std::vector<float> want(static_cast<size_t>(n)), got(static_cast<size_t>(n), -7.f);
      q4_matvec(blob.data(), m, x.data(), want.data());
      Q8Input xq;
      q8_quantize(x.data(), k, q8_block(m), &xq);
      q4_matvec_rows_q8(blob.data(), m, xq, 0, 5, got.data());
      q4_matvec_rows_q8(blob.data(), m, xq, 5, n, got.data());
      std::vector<float> row(static_cast<size_t>(k));
      for (int r = 0; r < n; ++r) {
        // Each input moves by at most half a step of its group's int8 grid.
        q4_dequantize_row(blob.data(), m, r, row.data());
        // The bias term uses the exact sum: only q * scale = w' - bias meets
        // the rounded inputs.
        double bound = 0;
        for (int c = 0; c < k; ++c) {
          const int gi = c / m.group;
          uint16_t sb[2];
          std::memcpy(sb, blob.data() + m.params_offset + (size_t(r) * (k / m.group) + gi) * 4, 4);
          const double qs = std::fabs(double(row[size_t(c)]) - f16_to_f32(sb[1]));
          bound += qs * xq.scale[size_t(c / xq.block)] * 0.5;
        }
        REQUIRE(std::fabs(got[size_t(r)] - want[size_t(r)]) <= bound * 1.01 + 1e-5);
      }
      // The first half of the inputs only (whole groups): x holds just those.
      const int half = (k / 2) / m.group * m.group;
      if (half == 0) continue;
      Q8Input hq;
      q8_quantize(x.data(), half, q8_block(m), &hq);
      q4_matvec_rows_q8(blob.data(), m, hq, 0, n, got.data(), half);
      for (int r = 0; r < n; ++r) {
        q4_dequantize_row(blob.data(), m, r, row.data());
        double exact = 0, bound = 0;
        for (int c = 0; c < half; ++c) {
          exact += double(row[size_t(c)]) * x[size_t(c)];
          uint16_t sb[2];
          std::memcpy(sb, blob.data() + m.params_offset + (size_t(r) * (k / m.group) + c / m.group) * 4, 4);
          bound += std::fabs(double(row[size_t(c)]) - f16_to_f32(sb[1])) * hq.scale[size_t(c / hq.block)] * 0.5;
        }
        REQUIRE(std::fabs(got[size_t(r)] - exact) <= bound * 1.01 + 1e-4);
      }
    }
}

TEST_CASE("an expert blob holds its three matrices without overlap", "[int4]") {
  const ExpertLayout e = expert_layout(64, 96, 64);
  const auto gate = random_matrix(96, 64, 1), up = random_matrix(96, 64, 2),
             down = random_matrix(64, 96, 3);
  std::vector<uint8_t> blob(e.blob_bytes, 0xCD);
  q4_quantize_matrix(gate.data(), e.gate, blob.data());
  q4_quantize_matrix(up.data(), e.up, blob.data());
  q4_quantize_matrix(down.data(), e.down, blob.data());
  check_round_trip(gate, e.gate, blob.data());
  check_round_trip(up, e.up, blob.data());
  check_round_trip(down, e.down, blob.data());
}

namespace {
// Thread CPU time: the machine running the tests is often shared.
double cpu_seconds() {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return double(ts.tv_sec) + 1e-9 * double(ts.tv_nsec);
}
}  // namespace

TEST_CASE("q4_matvec throughput", "[int4][.bench]") {
  for (int group : {64, 128}) {
    const ExpertLayout e = expert_layout(2048, 768, group);
    const auto w = random_matrix(768, 2048, 5);
    std::vector<uint8_t> blob(e.blob_bytes);
    q4_quantize_matrix(w.data(), e.gate, blob.data());
    std::vector<float> x(2048, 0.5f), y(768);
    const int reps = 200;
    const double t0 = cpu_seconds();
    for (int i = 0; i < reps; ++i) q4_matvec(blob.data(), e.gate, x.data(), y.data());
    const double s = cpu_seconds() - t0;
    WARN("q4_matvec 768x2048 G" << group << ": " << s / reps * 1e6 << " us/call (thread CPU time), "
                                << 768.0 * 2048 * reps / s / 1e9 << " G weights/s");
  }
}
