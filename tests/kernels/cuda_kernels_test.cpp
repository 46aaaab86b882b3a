// The CUDA kernels against their CPU twins (kernels/cpu, model/int4.h) on odd
// sizes, each with its stated tolerance. Without a CUDA device every case
// says SKIPPED and passes (CI has nvcc but no GPU).
#include <cuda_bf16.h>

#include <catch2/catch.hpp>
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <memory>
#include <numeric>
#include <random>
#include <set>
#include <span>
#include <vector>

#include "kernels/cpu/activation.h"
#include "kernels/cpu/attention.h"
#include "kernels/cpu/matmul.h"
#include "kernels/cpu/rmsnorm.h"
#include "kernels/cpu/rope.h"
#include "kernels/cpu/router.h"
#include "kernels/cpu/sampling.h"
#include "kernels/cuda/activation.cuh"
#include "kernels/cuda/attention.cuh"
#include "kernels/cuda/cuda_check.cuh"
#include "kernels/cuda/dense_matmul.cuh"
#include "kernels/cuda/embedding.cuh"
#include "kernels/cuda/host_share.cuh"
#include "kernels/cuda/mla.cuh"
#include "kernels/cuda/norm.cuh"
#include "kernels/cuda/q4_gemm.cuh"
#include "kernels/cuda/q4_gemv.cuh"
#include "kernels/cuda/rope.cuh"
#include "kernels/cuda/router.cuh"
#include "kernels/cuda/sampling.cuh"
#include "model/int4.h"
#include "tests/cuda_skip.h"

namespace {

using bf16 = __nv_bfloat16;

// The ids 0..n-1 of a paged KV pool's blocks in a random order (block
// tables over disjoint, shuffled blocks).
std::vector<int32_t> shuffled_blocks(int n, std::mt19937& rng) {
  std::vector<int32_t> perm(n);
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), rng);
  return perm;
}


#define REQUIRE_OK(expr)       \
  do {                         \
    const auto st_ = (expr);   \
    INFO(st_.error());         \
    REQUIRE(st_.ok());         \
  } while (0)

// A device buffer of n T's, freed on scope exit; poisoned with 0xFF bytes
// (NaN for floats) so unwritten outputs show.
template <typename T>
struct Dev {
  T* p = nullptr;
  size_t n = 0;
  explicit Dev(size_t count) : n(count) {
    REQUIRE(cudaMalloc(&p, std::max<size_t>(1, n) * sizeof(T)) == cudaSuccess);
    REQUIRE(cudaMemset(p, 0xFF, std::max<size_t>(1, n) * sizeof(T)) == cudaSuccess);
  }
  explicit Dev(const std::vector<T>& h) : Dev(h.size()) { put(h); }
  ~Dev() { cudaFree(p); }
  Dev(const Dev&) = delete;
  void put(const std::vector<T>& h) {
    REQUIRE(cudaMemcpy(p, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice) == cudaSuccess);
  }
  std::vector<T> get() const {
    std::vector<T> h(n);
    REQUIRE(cudaDeviceSynchronize() == cudaSuccess);
    REQUIRE(cudaMemcpy(h.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost) == cudaSuccess);
    return h;
  }
};

std::vector<float> randn(size_t n, std::mt19937& rng, float sd = 1.f) {
  std::normal_distribution<float> d(0.f, sd);
  std::vector<float> v(n);
  for (auto& x : v) x = d(rng);
  return v;
}

bf16 to_bf16(float f) { return __float2bfloat16(f); }
float from_bf16(bf16 b) { return __bfloat162float(b); }
std::vector<bf16> to_bf16(const std::vector<float>& v) {
  std::vector<bf16> o(v.size());
  for (size_t i = 0; i < v.size(); ++i) o[i] = to_bf16(v[i]);
  return o;
}
std::vector<float> round_bf16(const std::vector<float>& v) {
  std::vector<float> o(v.size());
  for (size_t i = 0; i < v.size(); ++i) o[i] = from_bf16(to_bf16(v[i]));
  return o;
}
std::vector<uint16_t> bf16_bits(const std::vector<float>& v) {
  std::vector<uint16_t> o(v.size());
  for (size_t i = 0; i < v.size(); ++i) {
    const bf16 b = to_bf16(v[i]);
    std::memcpy(&o[i], &b, 2);
  }
  return o;
}

// ||got - ref|| / ||ref||; NaN (an unwritten output) never passes.
double rel_err(const std::vector<float>& got, const std::vector<float>& ref) {
  REQUIRE(got.size() == ref.size());
  double num = 0, den = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    if (!std::isfinite(got[i])) return INFINITY;
    num += (double(got[i]) - ref[i]) * (double(got[i]) - ref[i]);
    den += double(ref[i]) * ref[i];
  }
  return std::sqrt(num / std::max(den, 1e-30));
}
std::vector<float> as_float(const std::vector<bf16>& v) {
  std::vector<float> o(v.size());
  for (size_t i = 0; i < v.size(); ++i) o[i] = from_bf16(v[i]);
  return o;
}

// The inputs the fused dense GEMVs make while staging, made on the CPU and
// rounded to bf16 as the kernels stage them: RMSNorm of residual rows, and
// SiLU(gate) * up of rows of gate|up `stride` apart.
std::vector<float> rmsnorm_bf16(const std::vector<float>& res, const std::vector<float>& nw, int tokens, int k) {
  std::vector<float> xn(res.size());
  moe::cpu::rmsnorm(res.data(), nw.data(), xn.data(), tokens, k, 1e-6f);
  return round_bf16(xn);
}

std::vector<float> silu_input_bf16(const std::vector<float>& gu, int tokens, int k, int stride) {
  std::vector<float> h(size_t(tokens) * k);
  for (int t = 0; t < tokens; ++t)
    moe::cpu::silu_mul(gu.data() + size_t(t) * stride, gu.data() + size_t(t) * stride + k, h.data() + size_t(t) * k,
                       k);
  return round_bf16(h);
}

// The quantised GEMVs' fused-input cases, drawn in this order. RMSNorm: the
// f32 residual, bf16 norm weights, outputs to accumulate into, per-token
// gates, and the CPU's bf16 normed input.
struct NormInputCase {
  std::vector<float> res, nw, y0, gate, xnb;
};
NormInputCase norm_input_case(int tokens, int k, int n_out, std::mt19937& rng) {
  NormInputCase c;
  c.res = randn(size_t(tokens) * k, rng, 2.f);
  c.nw = round_bf16(randn(k, rng));
  c.y0 = randn(size_t(tokens) * n_out, rng);
  c.gate = randn(tokens, rng);
  c.xnb = rmsnorm_bf16(c.res, c.nw, tokens, k);
  return c;
}
// SiLU(gate) * up: gate|up rows `stride` apart, outputs, gates, and the
// CPU's bf16 product.
struct SiluInputCase {
  int stride = 0;
  std::vector<float> gu, y0, gate, hb;
};
SiluInputCase silu_input_case(int tokens, int k, int n_out, std::mt19937& rng) {
  SiluInputCase c;
  c.stride = 2 * k + 3;
  c.gu = randn(size_t(tokens) * c.stride, rng);
  c.y0 = randn(size_t(tokens) * n_out, rng);
  c.gate = randn(tokens, rng);
  c.hb = silu_input_bf16(c.gu, tokens, k, c.stride);
  return c;
}

// An expert blob quantised from random weights.
std::vector<uint8_t> make_expert(const moe::ExpertLayout& L, std::mt19937& rng) {
  std::vector<uint8_t> blob(L.blob_bytes, 0);
  for (const moe::Q4MatrixLayout* m : {&L.gate, &L.up, &L.down}) {
    const auto w = randn(size_t(m->rows) * m->cols, rng, 0.05f);
    moe::q4_quantize_matrix(w.data(), *m, blob.data());
  }
  return blob;
}

}  // namespace

TEST_CASE("cuda q4_gemv matches q4_matvec on odd shapes, f32 and bf16 inputs", "[cuda][q4]") {
  SKIP_WITHOUT_GPU();
  // (hidden, inter, group): fast path with 1, 2 and 4 chunks per lane, group
  // 32 and 128, and the byte-wise path (K not a multiple of 32, tiny groups).
  const int shapes[][3] = {{2048, 1411 * 2, 64}, {768, 77 * 2, 64}, {4096, 130, 128}, {96, 46, 64},
                           {200, 130, 64},       {6, 10, 64}};
  std::mt19937 rng(11);
  for (const auto& s : shapes) {
    const auto L = moe::expert_layout(s[0], s[1], s[2]);
    const auto blob = make_expert(L, rng);
    Dev<uint8_t> dblob(blob);
    for (const moe::Q4MatrixLayout* m : {&L.gate, &L.down}) {
      INFO("rows " << m->rows << " cols " << m->cols << " group " << m->group);
      const auto x = randn(m->cols, rng);
      const auto xb = round_bf16(x);
      std::vector<float> ref(m->rows), refb(m->rows);
      moe::q4_matvec(blob.data(), *m, x.data(), ref.data());
      moe::q4_matvec(blob.data(), *m, xb.data(), refb.data());
      Dev<float> dx(x), dy(m->rows);
      Dev<bf16> dxb(to_bf16(x));
      REQUIRE_OK(moe::cuda::q4_gemv(dblob.p, *m, dx.p, dy.p, nullptr));
      CHECK(rel_err(dy.get(), ref) < 3e-3);
      REQUIRE_OK(moe::cuda::q4_gemv(dblob.p, *m, dxb.p, dy.p, nullptr));
      CHECK(rel_err(dy.get(), refb) < 3e-3);
    }
  }
}

TEST_CASE("cuda q4_gemv rejects bad shapes", "[cuda][q4]") {
  SKIP_WITHOUT_GPU();
  moe::Q4MatrixLayout m;
  m.rows = 4;
  m.cols = 7;  // odd
  m.group = 2;
  Dev<uint8_t> blob(256);
  Dev<float> x(8), y(4);
  CHECK_FALSE(moe::cuda::q4_gemv(blob.p, m, x.p, y.p, nullptr).ok());
  m.cols = 8;
  m.group = 3;
  CHECK_FALSE(moe::cuda::q4_gemv(blob.p, m, x.p, y.p, nullptr).ok());
}

namespace {

struct MoeCase {
  int hidden, inter, group, tokens, top_k, n_experts;
};

// CPU reference of the routed MoE: out[t] += sum_k w * down(silu(gate x) * up x);
// with `split`, a pair's intermediate rows below split[pair] count as zero
// (they are the host's: Q4ExpertArgs::split).
void moe_reference(const moe::ExpertLayout& L, const std::vector<std::vector<uint8_t>>& blobs,
                   const std::vector<int32_t>& ids, const std::vector<float>& wts, const std::vector<float>& x,
                   int tokens, int top_k, bool round_h, std::vector<float>& out,
                   const std::vector<int32_t>* split = nullptr) {
  std::vector<float> g(L.inter), u(L.inter), h(L.inter), y(L.hidden);
  for (int t = 0; t < tokens; ++t)
    for (int k = 0; k < top_k; ++k) {
      const int e = ids[t * top_k + k];
      if (e < 0 || e >= int(blobs.size())) continue;
      moe::q4_matvec(blobs[e].data(), L.gate, x.data() + size_t(t) * L.hidden, g.data());
      moe::q4_matvec(blobs[e].data(), L.up, x.data() + size_t(t) * L.hidden, u.data());
      moe::cpu::silu_mul(g.data(), u.data(), h.data(), L.inter);
      if (split) std::fill(h.begin(), h.begin() + std::min((*split)[size_t(t * top_k + k)], L.inter), 0.f);
      if (round_h) h = round_bf16(h);
      moe::q4_matvec(blobs[e].data(), L.down, h.data(), y.data());
      for (int i = 0; i < L.hidden; ++i) out[size_t(t) * L.hidden + i] += wts[t * top_k + k] * y[i];
    }
}

struct MoeData {
  moe::ExpertLayout L;
  std::vector<std::vector<uint8_t>> blobs;
  std::vector<int32_t> ids;
  std::vector<float> wts, x, out0;
};

MoeData make_moe(const MoeCase& c, std::mt19937& rng) {
  MoeData d;
  d.L = moe::expert_layout(c.hidden, c.inter, c.group);
  for (int e = 0; e < c.n_experts; ++e) d.blobs.push_back(make_expert(d.L, rng));
  std::uniform_int_distribution<int> pick(0, c.n_experts - 1);
  for (int i = 0; i < c.tokens * c.top_k; ++i) d.ids.push_back(pick(rng));
  d.ids[1] = -1;  // a slot with no expert is skipped
  d.wts = randn(d.ids.size(), rng);
  d.x = round_bf16(randn(size_t(c.tokens) * c.hidden, rng));
  d.out0 = randn(size_t(c.tokens) * c.hidden, rng);
  return d;
}

}  // namespace

TEST_CASE("cuda decode expert kernels (gate/up + SiLU, weighted down) match the CPU", "[cuda][q4]") {
  SKIP_WITHOUT_GPU();
  // Qwen3-like (down: 8 slots x 24 chunks, 6 a lane), Qwen1.5-like at 8
  // tokens (4 x 44, 6 a lane), one item a lane, an odd chunk count with
  // group 32, more pairs than the flat down kernel takes (8 x 40), and a
  // shape outside the fast layout. The ids are drawn with repeats, so
  // tokens share experts (and one token may name an expert twice): a grouped
  // block serves several pairs, more than 8 of them in the last case but one.
  const MoeCase cases[] = {{256, 192, 64, 3, 4, 6},    {2048, 768, 64, 2, 8, 9}, {2048, 1408, 64, 8, 4, 12},
                           {96, 224, 32, 3, 3, 5},     {512, 1280, 64, 2, 8, 9}, {200, 130, 64, 3, 5, 4},
                           {2048, 768, 64, 8, 8, 20},  {256, 128, 64, 8, 8, 3}};
  std::mt19937 rng(12);
  for (const auto& c : cases) {
    INFO("hidden " << c.hidden << " inter " << c.inter << " top_k " << c.top_k);
    MoeData d = make_moe(c, rng);
    std::vector<Dev<uint8_t>*> dblobs;
    std::vector<const uint8_t*> ptrs;
    for (auto& b : d.blobs) {
      dblobs.push_back(new Dev<uint8_t>(b));
      ptrs.push_back(dblobs.back()->p);
    }
    Dev<const uint8_t*> dptrs(ptrs);
    Dev<int32_t> dids(d.ids);
    Dev<float> dw(d.wts), dout(d.out0), dh(d.ids.size() * size_t(c.inter));
    Dev<bf16> dx(to_bf16(d.x));
    moe::cuda::Q4ExpertArgs a;
    a.layout = d.L;
    a.blobs = dptrs.p;
    a.n_experts = c.n_experts;
    a.expert_ids = dids.p;
    a.route_weights = dw.p;
    a.tokens = c.tokens;
    a.top_k = c.top_k;
    // Then again with some pairs' first rows left to the host (whole 64-row
    // steps, none, or all of them).
    std::vector<int32_t> split(d.ids.size());
    for (size_t i = 0; i < split.size(); ++i) split[i] = i % 3 == 0 ? 0 : i % 3 == 1 ? 64 : c.inter;
    Dev<int32_t> dsplit(split);
    // Grouping: off, on, and on but for the even experts (read from device
    // memory: a block a pair).
    std::vector<uint8_t> even(size_t(c.n_experts));
    for (int e = 0; e < c.n_experts; ++e) even[size_t(e)] = e % 2 == 0;
    Dev<uint8_t> deven(even);
    for (const int variant : {0, 1, 2, 3, 4, 5}) {
      const bool with_split = variant & 1;
      INFO("split " << with_split << ", pairs of one expert grouped " << (variant >> 1));
      a.split = with_split ? dsplit.p : nullptr;
      a.group_pairs = variant >= 2;
      a.resident = variant >= 4 ? deven.p : nullptr;
      dout.put(d.out0);
      // On a stream of its own the kernels overlap through programmatic
      // dependent launch; the result must not change.
      cudaStream_t stream;
      REQUIRE(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking) == cudaSuccess);
      REQUIRE_OK(moe::cuda::q4_expert_gate_up(a, dx.p, dh.p, stream));
      REQUIRE_OK(moe::cuda::q4_expert_down(a, dh.p, dout.p, /*accumulate=*/true, stream));
      REQUIRE(cudaStreamSynchronize(stream) == cudaSuccess);
      REQUIRE(cudaStreamDestroy(stream) == cudaSuccess);
      std::vector<float> ref = d.out0;
      moe_reference(d.L, d.blobs, d.ids, d.wts, d.x, c.tokens, c.top_k, false, ref, with_split ? &split : nullptr);
      // Compare the MoE contribution (out - out0), not the residual it rides on.
      auto got = dout.get();
      for (size_t i = 0; i < got.size(); ++i) {
        got[i] -= d.out0[i];
        ref[i] -= d.out0[i];
      }
      CHECK(rel_err(got, ref) < 5e-3);
    }
    for (auto* b : dblobs) delete b;
  }
}

TEST_CASE("cuda grouped INT4 MoE GEMM matches the CPU", "[cuda][q4]") {
  SKIP_WITHOUT_GPU();
  // Tiles of 32 pairs (a few pairs an expert: the first, the third, and the
  // Qwen3-30B expert shape over 32 steps of K) and of 64 (the second: ~170 an
  // expert, several tiles each).
  const MoeCase cases[] = {{256, 192, 64, 37, 4, 10},
                           {512, 320, 64, 150, 8, 7},
                           {128, 64, 32, 1, 2, 3},
                           {2048, 768, 64, 48, 8, 32}};
  std::mt19937 rng(13);
  for (const auto& c : cases) {
    INFO("hidden " << c.hidden << " inter " << c.inter << " tokens " << c.tokens);
    MoeData d = make_moe(c, rng);
    REQUIRE(moe::cuda::q4_grouped_supported(d.L));
    std::vector<Dev<uint8_t>*> dblobs;
    std::vector<const uint8_t*> ptrs;
    for (auto& b : d.blobs) {
      dblobs.push_back(new Dev<uint8_t>(b));
      ptrs.push_back(dblobs.back()->p);
    }
    Dev<const uint8_t*> dptrs(ptrs);
    Dev<int32_t> dids(d.ids);
    Dev<float> dw(d.wts), dout(d.out0);
    Dev<bf16> dx(to_bf16(d.x));
    moe::cuda::Q4ExpertArgs a;
    a.layout = d.L;
    a.blobs = dptrs.p;
    a.n_experts = c.n_experts;
    a.expert_ids = dids.p;
    a.route_weights = dw.p;
    a.tokens = c.tokens;
    a.top_k = c.top_k;
    const size_t ws = moe::cuda::q4_grouped_workspace_bytes(d.L, c.tokens, c.top_k, c.n_experts);
    Dev<uint8_t> dws(ws);
    REQUIRE_OK(moe::cuda::q4_grouped_moe(a, dx.p, dout.p, dws.p, ws, nullptr));
    std::vector<float> ref = d.out0;
    moe_reference(d.L, d.blobs, d.ids, d.wts, d.x, c.tokens, c.top_k, true, ref);
    auto got = dout.get();
    for (size_t i = 0; i < got.size(); ++i) {
      got[i] -= d.out0[i];
      ref[i] -= d.out0[i];
    }
    // bf16 tensor-core inputs (the dequantised weights, h): 1e-2.
    CHECK(rel_err(got, ref) < 1e-2);
    for (auto* b : dblobs) delete b;
  }
  CHECK_FALSE(moe::cuda::q4_grouped_supported(moe::expert_layout(200, 130, 64)));
}

TEST_CASE("cuda rmsnorm and add_rmsnorm match the CPU", "[cuda][norm]") {
  SKIP_WITHOUT_GPU();
  std::mt19937 rng(14);
  const int rows = 7, dim = 1001;
  const float eps = 1e-6f;
  const auto x = randn(size_t(rows) * dim, rng, 3.f), add = randn(size_t(rows) * dim, rng);
  const auto w = round_bf16(randn(dim, rng));
  std::vector<float> ref(x.size());
  moe::cpu::rmsnorm(x.data(), w.data(), ref.data(), rows, dim, eps);
  Dev<float> dx(x), dadd(add), dy(x.size());
  Dev<bf16> dw(to_bf16(w)), dyb(x.size());
  REQUIRE_OK(moe::cuda::rmsnorm(dx.p, dw.p, dy.p, rows, dim, eps, nullptr));
  CHECK(rel_err(dy.get(), ref) < 1e-5);
  REQUIRE_OK(moe::cuda::rmsnorm(dx.p, dw.p, dyb.p, rows, dim, eps, nullptr));
  CHECK(rel_err(as_float(dyb.get()), ref) < 8e-3);

  std::vector<float> sum(x.size());
  for (size_t i = 0; i < x.size(); ++i) sum[i] = x[i] + add[i];
  moe::cpu::rmsnorm(sum.data(), w.data(), ref.data(), rows, dim, eps);
  REQUIRE_OK(moe::cuda::add_rmsnorm(dx.p, dadd.p, dw.p, dyb.p, rows, dim, eps, nullptr));
  CHECK(rel_err(dx.get(), sum) < 1e-6);
  CHECK(rel_err(as_float(dyb.get()), ref) < 8e-3);
}

TEST_CASE("cuda silu_mul matches the CPU", "[cuda][activation]") {
  SKIP_WITHOUT_GPU();
  std::mt19937 rng(15);
  const int rows = 3, inter = 333;
  const auto gu = randn(size_t(rows) * 2 * inter, rng, 2.f);
  std::vector<float> g(size_t(rows) * inter), u(g.size()), ref(g.size());
  for (int r = 0; r < rows; ++r)
    for (int i = 0; i < inter; ++i) {
      g[size_t(r) * inter + i] = gu[size_t(r) * 2 * inter + i];
      u[size_t(r) * inter + i] = gu[size_t(r) * 2 * inter + inter + i];
    }
  moe::cpu::silu_mul(g.data(), u.data(), ref.data(), int64_t(g.size()));
  Dev<float> dg(g), du(u), dout(g.size()), dgu(gu);
  Dev<bf16> dob(g.size());
  REQUIRE_OK(moe::cuda::silu_mul(dg.p, du.p, dout.p, int64_t(g.size()), nullptr));
  CHECK(rel_err(dout.get(), ref) < 1e-5);
  REQUIRE_OK(moe::cuda::silu_mul_fused(dgu.p, dob.p, rows, inter, nullptr));
  CHECK(rel_err(as_float(dob.get()), ref) < 8e-3);
}

TEST_CASE("cuda router softmax + top-k matches the CPU", "[cuda][router]") {
  SKIP_WITHOUT_GPU();
  std::mt19937 rng(16);
  const int cfg[][3] = {{60, 4, 0}, {128, 8, 1}, {7, 7, 1}};
  for (const auto& c : cfg) {
    const int tokens = 9, n = c[0], k = c[1];
    const bool renorm = c[2];
    INFO("n_experts " << n << " top_k " << k);
    const auto logits = randn(size_t(tokens) * n, rng, 2.f);
    moe::cpu::RouterParams p;
    p.n_experts = n;
    p.top_k = k;
    p.renormalize = renorm;
    std::vector<int32_t> ids(size_t(tokens) * k);
    std::vector<float> w(ids.size());
    moe::cpu::router_topk(logits.data(), tokens, p, ids.data(), w.data());
    Dev<float> dl(logits), dw(w.size());
    Dev<int32_t> did(ids.size());
    REQUIRE_OK(moe::cuda::router_topk(dl.p, tokens, n, k, renorm, 1.f, did.p, dw.p, nullptr));
    CHECK(did.get() == ids);
    CHECK(rel_err(dw.get(), w) < 1e-5);
  }
}

namespace {

// The uniform draw as router.cuh states it, on the host: a hash of (seed,
// layer, position, sequence) per token, each pick moved to the next free
// index when already taken. Pins the kernel's ids bit for bit, so that
// uniform-routing figures measured before and after a change are of the
// same routes.
uint64_t mix64_host(uint64_t z) {
  z += 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

std::vector<int32_t> uniform_draw_host(int n, int k, const std::vector<int32_t>& pos,
                                       const std::vector<int32_t>& seq, int layer, uint64_t seed) {
  std::vector<int32_t> ids(pos.size() * size_t(k));
  for (size_t t = 0; t < pos.size(); ++t) {
    const uint64_t key = (uint64_t(layer) << 40) ^ (uint64_t(uint32_t(pos[t])) << 8) ^ uint64_t(uint32_t(seq[t]));
    uint64_t h = mix64_host(seed ^ mix64_host(key));
    int32_t* row = ids.data() + t * size_t(k);
    for (int j = 0; j < k; ++j) {
      h = mix64_host(h);
      int e = int(h % uint64_t(n));
      while (std::find(row, row + j, e) != row + j) e = (e + 1) % n;
      row[j] = e;
    }
  }
  return ids;
}

}  // namespace

TEST_CASE("cuda uniform routing draws distinct experts evenly and deterministically", "[cuda][router]") {
  SKIP_WITHOUT_GPU();
  const int n = 128, k = 8, tokens = 4096;
  std::vector<int32_t> pos(tokens), seq(tokens);
  for (int t = 0; t < tokens; ++t) pos[size_t(t)] = t / 8, seq[size_t(t)] = t % 8;
  Dev<int32_t> dpos(pos), dseq(seq), did(size_t(tokens) * k);
  auto draw = [&](int layer, uint64_t seed) {
    REQUIRE_OK(moe::cuda::force_experts({dpos.p, dseq.p, layer, seed}, did.p, tokens, n, k, nullptr));
    return did.get();
  };
  const auto a = draw(3, 7), b = draw(3, 7), c = draw(4, 7), d = draw(3, 8);
  CHECK(a == b);  // a function of (seed, layer, position, sequence) only
  CHECK(a != c);
  CHECK(a != d);
  CHECK(a == uniform_draw_host(n, k, pos, seq, 3, 7));
  CHECK(d == uniform_draw_host(n, k, pos, seq, 3, 8));
  std::vector<int> count(n, 0);
  for (int t = 0; t < tokens; ++t) {
    std::vector<int32_t> row(a.begin() + t * k, a.begin() + (t + 1) * k);
    for (int32_t e : row) {
      REQUIRE(e >= 0);
      REQUIRE(e < n);
      ++count[size_t(e)];
    }
    std::sort(row.begin(), row.end());
    REQUIRE(std::adjacent_find(row.begin(), row.end()) == row.end());
  }
  // 32,768 draws over 128 experts: 256 expected each; a chi-square with 127
  // degrees of freedom stays below 200 with probability > 0.9999.
  double chi2 = 0;
  for (int v : count) chi2 += (v - 256.0) * (v - 256.0) / 256.0;
  CHECK(chi2 < 200);
  // k = n: every expert once.
  const std::vector<int32_t> one_pos = {5}, one_seq = {0};
  Dev<int32_t> p1(one_pos), s1(one_seq), all{size_t(n)};
  REQUIRE_OK(moe::cuda::force_experts({p1.p, s1.p, 0, 1}, all.p, 1, n, n, nullptr));
  auto ids = all.get();
  CHECK(ids == uniform_draw_host(n, n, one_pos, one_seq, 0, 1));
  std::sort(ids.begin(), ids.end());
  for (int i = 0; i < n; ++i) CHECK(ids[size_t(i)] == i);
  // After router_topk, as a pass runs it: the draw's ids, the router's own
  // weights untouched.
  std::vector<float> logits(size_t(tokens) * n);
  std::mt19937 rng(9);
  std::normal_distribution<float> nd(0.f, 2.f);
  for (float& v : logits) v = nd(rng);
  Dev<float> dl(logits), w0(size_t(tokens) * k), w1(size_t(tokens) * k);
  Dev<int32_t> routed(size_t(tokens) * k);
  REQUIRE_OK(moe::cuda::router_topk(dl.p, tokens, n, k, true, 1.f, routed.p, w0.p, nullptr));
  const auto w0_h = w0.get();
  const auto routed_h = routed.get();
  REQUIRE_OK(moe::cuda::router_topk(dl.p, tokens, n, k, true, 1.f, routed.p, w1.p, nullptr));
  REQUIRE_OK(moe::cuda::force_experts({dpos.p, dseq.p, 3, 7}, routed.p, tokens, n, k, nullptr));
  CHECK(routed.get() == a);
  CHECK(routed_h != a);
  CHECK(w1.get() == w0_h);
  // A bad call is refused, not launched.
  CHECK(!moe::cuda::force_experts({nullptr, dseq.p, 0, 1}, did.p, tokens, n, k, nullptr).ok());
  CHECK(!moe::cuda::force_experts({dpos.p, dseq.p, 0, 1}, did.p, tokens, n, n + 1, nullptr).ok());
}

TEST_CASE("cuda replayed routing walks a recorded trace from each sequence's offset", "[cuda][router]") {
  SKIP_WITHOUT_GPU();
  // A trace of 37 tokens, 3 layers, k = 4, every row distinct.
  const int T = 37, L = 3, k = 4, n = 64;
  std::vector<int16_t> trace(size_t(T) * L * k);
  for (int r = 0; r < T; ++r)
    for (int l = 0; l < L; ++l)
      for (int j = 0; j < k; ++j) trace[(size_t(r) * L + l) * k + j] = int16_t((r * 7 + l * 13 + j * 16) % n);
  Dev<int16_t> dtrace(trace);
  // Two sequences, 50 positions each (more than the trace: it wraps).
  std::vector<int32_t> pos, seq;
  for (int s : {11, 4242})
    for (int p = 0; p < 50; ++p) pos.push_back(p), seq.push_back(s);
  const int tokens = int(pos.size());
  Dev<int32_t> dpos(pos), dseq(seq), did(size_t(tokens) * k);
  for (int layer = 0; layer < L; ++layer) {
    moe::cuda::ForcedRouting route{dpos.p, dseq.p, layer, 0, dtrace.p, T, L};
    REQUIRE_OK(moe::cuda::force_experts(route, did.p, tokens, n, k, nullptr));
    const auto ids = did.get();
    for (int t = 0; t < tokens; ++t) {
      const int r = moe::cuda::replay_row(seq[size_t(t)], pos[size_t(t)], T);
      REQUIRE(r >= 0);
      REQUIRE(r < T);
      if (pos[size_t(t)] > 0)  // consecutive positions take consecutive rows
        CHECK(r == (moe::cuda::replay_row(seq[size_t(t)], pos[size_t(t)] - 1, T) + 1) % T);
      for (int j = 0; j < k; ++j) CHECK(ids[size_t(t) * k + j] == trace[(size_t(r) * L + layer) * k + j]);
    }
  }
  // The two sequences start at different places of the recording.
  CHECK(moe::cuda::replay_row(11, 0, T) != moe::cuda::replay_row(4242, 0, T));
  // A layer the trace does not hold is refused.
  moe::cuda::ForcedRouting bad{dpos.p, dseq.p, L, 0, dtrace.p, T, L};
  CHECK(!moe::cuda::force_experts(bad, did.p, tokens, n, k, nullptr).ok());
}

TEST_CASE("cuda uniform draw posts the host's share from the drawn ids", "[cuda][router]") {
  SKIP_WITHOUT_GPU();
  // The draw kernel's own post must equal share_publish run after it, for
  // one token (where the router would post it itself) and for several.
  const int n = 128, k = 8, hidden = 64, inter = 64;
  for (int tokens : {1, 3}) {
    INFO("tokens " << tokens);
    std::mt19937 rng(uint32_t(20 + tokens));
    std::vector<int32_t> pos(static_cast<size_t>(tokens)), seq(static_cast<size_t>(tokens));
    for (int t = 0; t < tokens; ++t) pos[size_t(t)] = 40 + t, seq[size_t(t)] = t;
    std::vector<uint8_t> on_gpu(static_cast<size_t>(n));
    for (int e = 0; e < n; ++e) on_gpu[size_t(e)] = uint8_t(e % 2);  // odd experts on the GPU
    std::vector<uint16_t> rows(size_t(tokens) * k + 1, uint16_t(16));  // the host's rows of each miss
    std::vector<bf16> xn(size_t(tokens) * hidden);
    for (auto& v : xn) v = to_bf16(std::normal_distribution<float>(0.f, 1.f)(rng));
    const auto logits = randn(size_t(tokens) * n, rng, 2.f);
    const std::vector<uint32_t> pass = {77};
    Dev<int32_t> dpos(pos), dseq(seq);
    Dev<uint8_t> don(on_gpu);
    Dev<uint16_t> drows(rows);
    Dev<bf16> dxn(xn);
    Dev<float> dl(logits), dw(size_t(tokens) * k);
    Dev<uint32_t> dpass(pass);
    struct Out {
      Dev<int32_t> ids, gpu_ids, gpu_split;
      Dev<moe::ShareSlot> slot{1};
      Dev<bf16> x_host;
      Dev<uint32_t> count{1};
      Out(int tokens, int k, int hidden)
          : ids(size_t(tokens) * k), gpu_ids(size_t(tokens) * k), gpu_split(size_t(tokens) * k),
            x_host(size_t(tokens) * hidden) {}
    };
    auto args = [&](Out& o) {
      moe::cuda::SharePublishArgs a;
      a.tokens = tokens;
      a.ids = o.ids.p;
      a.route_w = dw.p;
      a.on_gpu = don.p;
      a.rows = drows.p;
      a.top_k = k;
      a.n_experts = n;
      a.inter = inter;
      a.xn = dxn.p;
      a.hidden = hidden;
      a.slot = o.slot.p;
      a.x_host = o.x_host.p;
      a.pass = dpass.p;
      a.gpu_ids = o.gpu_ids.p;
      a.gpu_split = o.gpu_split.p;
      a.host_count = o.count.p;
      return a;
    };
    const moe::cuda::ForcedRouting ud{dpos.p, dseq.p, 2, 5};
    Out fused(tokens, k, hidden), apart(tokens, k, hidden);
    const auto fa = args(fused), pa = args(apart);
    REQUIRE_OK(moe::cuda::router_topk(dl.p, tokens, n, k, true, 1.f, fused.ids.p, dw.p, nullptr));
    REQUIRE_OK(moe::cuda::force_experts(ud, fused.ids.p, tokens, n, k, nullptr, &fa));
    REQUIRE_OK(moe::cuda::router_topk(dl.p, tokens, n, k, true, 1.f, apart.ids.p, dw.p, nullptr));
    REQUIRE_OK(moe::cuda::force_experts(ud, apart.ids.p, tokens, n, k, nullptr));
    REQUIRE_OK(moe::cuda::share_publish(pa, nullptr));
    const auto ids = fused.ids.get();
    CHECK(ids == uniform_draw_host(n, k, pos, seq, 2, 5));
    CHECK(ids == apart.ids.get());
    const auto s1 = fused.slot.get(), s2 = apart.slot.get();
    REQUIRE(s1[0].posted == 77);
    int missed = 0;
    for (int32_t e : ids) missed += on_gpu[size_t(e)] ? 0 : 1;
    REQUIRE(missed > 0);
    CHECK(s1[0].count == uint32_t(missed));
    CHECK(std::memcmp(&s1[0], &s2[0], sizeof(moe::ShareSlot)) == 0);
    CHECK(fused.gpu_ids.get() == apart.gpu_ids.get());
    CHECK(fused.gpu_split.get() == apart.gpu_split.get());
    CHECK(fused.count.get() == apart.count.get());
    const auto x1 = fused.x_host.get(), x2 = apart.x_host.get();
    CHECK(std::memcmp(x1.data(), x2.data(), x1.size() * sizeof(bf16)) == 0);
    // More tokens than one warp's post takes are refused.
    auto big = fa;
    big.tokens = 9;
    CHECK(!moe::cuda::force_experts(ud, fused.ids.p, 9, n, k, nullptr, &big).ok());
  }
}

namespace {

// Heads and paging of a KV pool: head_dim, query heads, KV heads, block
// tokens, blocks per sequence.
struct AttentionShape {
  int hd, nh, nkv, bt, max_blocks;
};

moe::cuda::PagedKvPool kv_pool(bf16* k, bf16* v, const int32_t* tables, int max_blocks, int bt, int nkv, int hd) {
  moe::cuda::PagedKvPool kv;
  kv.k = k;
  kv.v = v;
  kv.block_tables = tables;
  kv.max_blocks = max_blocks;
  kv.block_tokens = bt;
  kv.n_kv = nkv;
  kv.head_dim = hd;
  return kv;
}

// The same over coded rows (docs/kv-cache.md): codes and scales on the device.
moe::cuda::PagedKvPool coded_pool(moe::KvDtype dt, Dev<uint8_t>& kc, Dev<uint8_t>& vc, Dev<float>& ks, Dev<float>& vs,
                                  const int32_t* tables, int max_blocks, int bt, int nkv, int hd) {
  moe::cuda::PagedKvPool kv = kv_pool(nullptr, nullptr, tables, max_blocks, bt, nkv, hd);
  kv.dtype = dt;
  kv.k_codes = kc.p;
  kv.v_codes = vc.p;
  kv.k_scales = ks.p;
  kv.v_scales = vs.p;
  return kv;
}

// After qkv_rope_store: its q output and the K and V rows it stored at each
// token's slot against the reference rows ref [tokens, q | k | v].
void check_stored_qkv(Dev<bf16>& dq, Dev<bf16>& dk, Dev<bf16>& dv, const std::vector<float>& ref,
                      const std::vector<int32_t>& tables, const std::vector<int32_t>& seq,
                      const std::vector<int32_t>& pos, const AttentionShape& sh) {
  const int hd = sh.hd, nh = sh.nh, nkv = sh.nkv, bt = sh.bt, max_blocks = sh.max_blocks;
  const int tokens = int(seq.size()), width = (nh + 2 * nkv) * hd;
  const auto q = as_float(dq.get()), k = as_float(dk.get()), v = as_float(dv.get());
  std::vector<float> gq, rq, gk, rk, gv, rv;
  for (int t = 0; t < tokens; ++t) {
    for (int i = 0; i < nh * hd; ++i) {
      gq.push_back(q[size_t(t) * nh * hd + i]);
      rq.push_back(ref[size_t(t) * width + i]);
    }
    const size_t slot = size_t(tables[seq[t] * max_blocks + pos[t] / bt]) * bt + pos[t] % bt;
    for (int i = 0; i < nkv * hd; ++i) {
      gk.push_back(k[slot * nkv * hd + i]);
      rk.push_back(ref[size_t(t) * width + nh * hd + i]);
      gv.push_back(v[slot * nkv * hd + i]);
      rv.push_back(ref[size_t(t) * width + (nh + nkv) * hd + i]);
    }
  }
  CHECK(rel_err(gq, rq) < 8e-3);
  CHECK(rel_err(gk, rk) < 8e-3);
  CHECK(rel_err(gv, rv) < 8e-3);
}

// qkv_rope_store's arguments every case sets: the inputs, positions and
// sequences, the RoPE table, the sizes and the q output (bias and norms off).
moe::cuda::QkvRopeArgs rope_args(const float* qkv, const int32_t* positions, const int32_t* seq_of_token,
                                 const float* inv_freq, int tokens, int n_heads, bf16* q_out) {
  moe::cuda::QkvRopeArgs a;
  a.qkv = qkv;
  a.positions = positions;
  a.seq_of_token = seq_of_token;
  a.inv_freq = inv_freq;
  a.tokens = tokens;
  a.n_heads = n_heads;
  a.q_out = q_out;
  return a;
}

}  // namespace

TEST_CASE("cuda qkv_rope_store (bias, per-head norm, RoPE, paged store) matches the CPU", "[cuda][rope]") {
  SKIP_WITHOUT_GPU();
  std::mt19937 rng(17);
  const int tokens = 5, nh = 6, nkv = 2, hd = 64, bt = 16, pool_blocks = 9, max_blocks = 4;
  const int width = (nh + 2 * nkv) * hd;
  const auto qkv = randn(size_t(tokens) * width, rng);
  const auto bias = round_bf16(randn(width, rng, 0.3f));
  const auto qn = round_bf16(randn(hd, rng)), kn = round_bf16(randn(hd, rng));
  // Two sequences with scattered blocks; tokens at positions across blocks.
  const std::vector<int32_t> tables = {3, 0, 7, 1, 8, 2, 5, 4};  // [2, max_blocks]
  const std::vector<int32_t> seq = {0, 0, 1, 1, 0}, pos = {0, 17, 5, 63, 40};
  const auto inv_freq = moe::cpu::rope_inv_freq_default(1e6f, hd);

  std::vector<float> ref = qkv;
  for (int t = 0; t < tokens; ++t)
    for (int i = 0; i < width; ++i) ref[size_t(t) * width + i] += bias[i];
  moe::cpu::rmsnorm_heads(ref.data(), width, qn.data(), tokens, nh, hd, 1e-6f);
  moe::cpu::rmsnorm_heads(ref.data() + nh * hd, width, kn.data(), tokens, nkv, hd, 1e-6f);
  moe::cpu::rope_neox(ref.data(), width, hd, pos.data(), tokens, nh, hd, inv_freq.data());
  moe::cpu::rope_neox(ref.data() + nh * hd, width, hd, pos.data(), tokens, nkv, hd, inv_freq.data());

  Dev<float> dqkv(qkv), dfreq(inv_freq);
  Dev<bf16> dbias(to_bf16(bias)), dqn(to_bf16(qn)), dkn(to_bf16(kn)), dq(size_t(tokens) * nh * hd);
  Dev<bf16> dk(size_t(pool_blocks) * bt * nkv * hd), dv(dk.n);
  Dev<int32_t> dtab(tables), dseq(seq), dpos(pos);
  const moe::cuda::PagedKvPool kv = kv_pool(dk.p, dv.p, dtab.p, max_blocks, bt, nkv, hd);
  moe::cuda::QkvRopeArgs a = rope_args(dqkv.p, dpos.p, dseq.p, dfreq.p, tokens, nh, dq.p);
  a.bias = dbias.p;
  a.q_norm = dqn.p;
  a.k_norm = dkn.p;
  REQUIRE_OK(moe::cuda::qkv_rope_store(a, kv, nullptr));
  check_stored_qkv(dq, dk, dv, ref, tables, seq, pos, AttentionShape{hd, nh, nkv, bt, max_blocks});
}

namespace {

// One qkv_rope_store run against the CPU engine's order (engine/forward.cpp):
// projection bias, q/k RMSNorm (per head, over the whole projection, or
// none), rotate-half RoPE, kv_store. 7 tokens of 3 sequences at positions
// that do not start at 0, scattered 8-slot blocks.
enum class QkNormCase { none, per_head, full_width };

void check_qkv_rope_store(int hd, int nh, int nkv, bool with_bias, QkNormCase norm, float eps,
                          std::mt19937& rng) {
  INFO("head_dim " << hd << ", heads " << nh << "/" << nkv << ", bias " << with_bias << ", norm "
                   << int(norm));
  const int tokens = 7, bt = 8, max_blocks = 6, seqs = 3, pool_blocks = seqs * max_blocks + 2;
  const int width = (nh + 2 * nkv) * hd;
  const auto qkv = randn(size_t(tokens) * width, rng);
  const auto bias = round_bf16(randn(width, rng, 0.3f));
  const int qn_len = norm == QkNormCase::full_width ? nh * hd : hd;
  const int kn_len = norm == QkNormCase::full_width ? nkv * hd : hd;
  const auto qn = round_bf16(randn(qn_len, rng)), kn = round_bf16(randn(kn_len, rng));
  const std::vector<int32_t> perm = shuffled_blocks(pool_blocks, rng);
  const std::vector<int32_t> tables(perm.begin(), perm.begin() + seqs * max_blocks);
  // Distinct (sequence, position) pairs, so no two tokens share a slot.
  const std::vector<int32_t> seq = {0, 1, 2, 1, 0, 2, 1}, pos = {5, 9, 47, 30, 12, 33, 31};
  const auto inv_freq = moe::cpu::rope_inv_freq_default(1e4f, hd);

  std::vector<float> ref = qkv;
  if (with_bias)
    for (int t = 0; t < tokens; ++t)
      for (int i = 0; i < width; ++i) ref[size_t(t) * width + i] += bias[i];
  float* ref_q = ref.data();
  float* ref_k = ref.data() + nh * hd;
  if (norm == QkNormCase::per_head) {
    moe::cpu::rmsnorm_heads(ref_q, width, qn.data(), tokens, nh, hd, eps);
    moe::cpu::rmsnorm_heads(ref_k, width, kn.data(), tokens, nkv, hd, eps);
  } else if (norm == QkNormCase::full_width) {
    moe::cpu::rmsnorm(ref_q, width, qn.data(), ref_q, width, tokens, nh * hd, eps);
    moe::cpu::rmsnorm(ref_k, width, kn.data(), ref_k, width, tokens, nkv * hd, eps);
  }
  moe::cpu::rope_neox(ref_q, width, hd, pos.data(), tokens, nh, hd, inv_freq.data());
  moe::cpu::rope_neox(ref_k, width, hd, pos.data(), tokens, nkv, hd, inv_freq.data());

  Dev<float> dqkv(qkv), dfreq(inv_freq);
  Dev<bf16> dbias(to_bf16(bias)), dqn(to_bf16(qn)), dkn(to_bf16(kn)), dq(size_t(tokens) * nh * hd);
  Dev<bf16> dk(size_t(pool_blocks) * bt * nkv * hd), dv(dk.n);
  Dev<int32_t> dtab(tables), dseq(seq), dpos(pos);
  const moe::cuda::PagedKvPool kv = kv_pool(dk.p, dv.p, dtab.p, max_blocks, bt, nkv, hd);
  moe::cuda::QkvRopeArgs a = rope_args(dqkv.p, dpos.p, dseq.p, dfreq.p, tokens, nh, dq.p);
  a.bias = with_bias ? dbias.p : nullptr;
  if (norm != QkNormCase::none) {
    a.q_norm = dqn.p;
    a.k_norm = dkn.p;
  }
  a.qk_norm_full_width = norm == QkNormCase::full_width;
  a.eps = eps;
  REQUIRE_OK(moe::cuda::qkv_rope_store(a, kv, nullptr));
  check_stored_qkv(dq, dk, dv, ref, tables, seq, pos, AttentionShape{hd, nh, nkv, bt, max_blocks});
}

}  // namespace

TEST_CASE("cuda qkv_rope_store with head_dim 16 and 32 matches the CPU", "[cuda][rope]") {
  SKIP_WITHOUT_GPU();
  std::mt19937 rng(21);
  // The fixtures' shapes: Qwen2 / Qwen2-MoE / Mixtral (16, bias or not, no
  // norm) and Qwen3-MoE (32, per-head norm); a 12-head token spans two blocks.
  check_qkv_rope_store(16, 4, 2, true, QkNormCase::none, 1e-6f, rng);
  check_qkv_rope_store(16, 4, 2, false, QkNormCase::none, 1e-5f, rng);
  check_qkv_rope_store(32, 4, 2, false, QkNormCase::per_head, 1e-6f, rng);
  check_qkv_rope_store(16, 6, 3, true, QkNormCase::per_head, 1e-6f, rng);
}

TEST_CASE("cuda qkv_rope_store full-width q/k norm (OLMoE) matches the CPU", "[cuda][rope]") {
  SKIP_WITHOUT_GPU();
  std::mt19937 rng(22);
  // The OLMoE fixture (16, 4/4 heads, eps 1e-5); k straddling two blocks
  // (6/3 heads); q over two blocks with GQA (32, 16/4); OLMoE's own shape
  // (128, 16/16: q over two blocks, k over two more).
  check_qkv_rope_store(16, 4, 4, false, QkNormCase::full_width, 1e-5f, rng);
  check_qkv_rope_store(16, 6, 3, true, QkNormCase::full_width, 1e-5f, rng);
  check_qkv_rope_store(32, 16, 4, true, QkNormCase::full_width, 1e-6f, rng);
  check_qkv_rope_store(128, 16, 16, false, QkNormCase::full_width, 1e-5f, rng);
}

namespace {

// Random queries for (seq[t], pos[t]) through the CPU's attention over
// `cpu`'s rows (each query's block table taken from `tables`) and the
// kernel over `gpu` (its tables the device copy of `tables`): the relative
// error of the kernel's output, the larger of its two walks (a block per
// query, and 16-query tiles where the head size takes them: tiles of one
// sequence's prompt and of several sequences' tokens alike).
double attention_error(const AttentionShape& sh, moe::cpu::PagedKv cpu, const moe::cuda::PagedKvPool& gpu,
                       const std::vector<int32_t>& tables, const std::vector<int32_t>& seq,
                       const std::vector<int32_t>& pos, std::mt19937& rng) {
  const int hd = sh.hd, nh = sh.nh, nkv = sh.nkv;
  const int tokens = int(seq.size());
  const auto q = round_bf16(randn(size_t(tokens) * nh * hd, rng));
  const float scale = 1.f / std::sqrt(float(hd));
  std::vector<float> ref(q.size());
  for (int t = 0; t < tokens; ++t) {
    cpu.block_table = tables.data() + seq[t] * sh.max_blocks;
    moe::cpu::attention(q.data() + size_t(t) * nh * hd, nh * hd, cpu, &pos[t], ref.data() + size_t(t) * nh * hd,
                        nh * hd, 1, nh, nkv, hd, hd, scale, nullptr);
  }
  Dev<bf16> dq(to_bf16(q)), dout(q.size());
  Dev<int32_t> dseq(seq), dpos(pos);
  moe::cuda::AttentionArgs a;
  a.q = dq.p;
  a.seq_of_token = dseq.p;
  a.positions = dpos.p;
  a.tokens = tokens;
  a.n_heads = nh;
  a.scale = scale;
  a.out = dout.p;
  double worst = 0;
  // A block per query, the same with long queries' keys split over up to
  // 16 blocks (twice: the merge must leave its counts ready for the next
  // call) and over up to 4, and query tiles; then split into runs of at
  // least 32 and 96 keys (short queries split too, runs of uneven tiles).
  const int splits = moe::cuda::kAttentionMaxSplits;
  Dev<float> dparts(std::max<size_t>(1, moe::cuda::attention_partials_floats(tokens, nh, splits, hd)));
  Dev<uint32_t> dcounts(std::vector<uint32_t>(size_t(tokens) * nh, 0u));
  for (const int variant : {0, 1, 2, 3, 4, 5, 6}) {
    const auto walk = variant == 4 ? moe::cuda::AttentionWalk::query_tiles : moe::cuda::AttentionWalk::per_query;
    if (walk == moe::cuda::AttentionWalk::query_tiles && !moe::cuda::attention_query_tiles_supported(hd)) continue;
    a.split_keys = variant == 5 ? 32 : variant == 6 ? 96 : moe::cuda::kAttentionSplitKeys;
    INFO((variant == 0 ? "a block a query" : variant != 4 ? "a block a query, keys split" : "query tiles")
         << ", splits up to " << (variant == 3 ? 4 : variant == 0 || variant == 4 ? 1 : splits) << ", runs of "
         << a.split_keys << "+ keys");
    a.walk = walk;
    a.max_splits = variant == 3 ? 4 : variant == 0 || variant == 4 ? 1 : splits;
    a.partials = a.max_splits > 1 ? dparts.p : nullptr;
    a.split_counts = a.max_splits > 1 ? dcounts.p : nullptr;
    dout.put(std::vector<bf16>(q.size(), __float2bfloat16(NAN)));  // every output must be written
    REQUIRE_OK(moe::cuda::paged_attention(a, gpu, nullptr));
    const double e = rel_err(as_float(dout.get()), ref);
    CHECK(std::isfinite(e));
    worst = std::max(worst, e);
  }
  CHECK(dcounts.get() == std::vector<uint32_t>(size_t(tokens) * nh, 0u));
  return worst;
}

// The same over f32 pools, bf16 on the device.
double paged_attention_error(const AttentionShape& sh, const std::vector<float>& kpool,
                             const std::vector<float>& vpool, const std::vector<int32_t>& tables,
                             const std::vector<int32_t>& seq, const std::vector<int32_t>& pos, std::mt19937& rng) {
  Dev<bf16> dk(to_bf16(kpool)), dv(to_bf16(vpool));
  Dev<int32_t> dtab(tables);
  const moe::cuda::PagedKvPool kv = kv_pool(dk.p, dv.p, dtab.p, sh.max_blocks, sh.bt, sh.nkv, sh.hd);
  return attention_error(sh, moe::cpu::PagedKv{kpool.data(), vpool.data(), nullptr, sh.bt}, kv, tables, seq, pos, rng);
}

}  // namespace

TEST_CASE("cuda paged attention (decode and prefill) matches the CPU", "[cuda][attention]") {
  SKIP_WITHOUT_GPU();
  std::mt19937 rng(18);
  for (int hd : {64, 128}) {
    const int nh = 8, nkv = 2, bt = 16, max_blocks = 8, pool_blocks = 20;
    INFO("head_dim " << hd);
    const auto kpool = round_bf16(randn(size_t(pool_blocks) * bt * nkv * hd, rng));
    const auto vpool = round_bf16(randn(kpool.size(), rng));
    const std::vector<int32_t> perm = shuffled_blocks(pool_blocks, rng);
    // Three sequences over disjoint, shuffled blocks.
    std::vector<int32_t> tables(perm.begin(), perm.begin() + 3 * max_blocks - 4);
    tables.resize(3 * max_blocks, 0);
    // Decode: one query per sequence (contexts 1, 77, 100); prefill: 37
    // queries of sequence 2 at positions 60..96.
    std::vector<int32_t> seq = {0, 1, 2}, pos = {0, 76, 99};
    for (int i = 0; i < 37; ++i) {
      seq.push_back(2);
      pos.push_back(60 + i);
    }
    CHECK(paged_attention_error(AttentionShape{hd, nh, nkv, bt, max_blocks}, kpool, vpool, tables, seq, pos, rng) <
          8e-3);
  }
}

TEST_CASE("cuda prompt attention on tensor cores matches the CPU for every query-group size", "[cuda][attention]") {
  SKIP_WITHOUT_GPU();
  std::mt19937 rng(31);
  struct Shape {
    int hd, nh, nkv;
  };
  // Groups of 1 (a block's four warps over 64 tokens of one head), 3 (the
  // same, heads not a power of two), 2 (32 tokens of two heads), 4 and 8
  // (16 tokens of four heads); each head size the tiles take.
  for (const Shape sh : {Shape{128, 4, 4}, Shape{128, 6, 2}, Shape{64, 4, 2}, Shape{128, 8, 2}, Shape{128, 16, 2},
                         Shape{32, 8, 8}}) {
    const int hd = sh.hd, nh = sh.nh, nkv = sh.nkv, bt = 16, seqs = 3, max_blocks = 40;
    const int pool_blocks = seqs * max_blocks + 3;
    INFO("head_dim " << hd << ", heads " << nh << "/" << nkv);
    const auto kpool = round_bf16(randn(size_t(pool_blocks) * bt * nkv * hd, rng));
    const auto vpool = round_bf16(randn(kpool.size(), rng, 1.5f));
    const std::vector<int32_t> perm = shuffled_blocks(pool_blocks, rng);
    const std::vector<int32_t> tables(perm.begin(), perm.begin() + seqs * max_blocks);
    // A 300-token prompt from position 0 (causal tiles of 64 keys, a ragged
    // last one), a 41-token chunk continuing a 500-token context, and 17
    // tokens of a third prompt: runs that start and end inside a block's rows.
    std::vector<int32_t> seq, pos;
    for (int i = 0; i < 300; ++i) seq.push_back(0), pos.push_back(i);
    for (int i = 0; i < 41; ++i) seq.push_back(1), pos.push_back(500 + i);
    for (int i = 0; i < 17; ++i) seq.push_back(2), pos.push_back(i);
    CHECK(paged_attention_error(AttentionShape{hd, nh, nkv, bt, max_blocks}, kpool, vpool, tables, seq, pos, rng) <
          8e-3);
  }
}

TEST_CASE("cuda decode attention over long contexts, keys split over blocks, matches the CPU", "[cuda][attention]") {
  SKIP_WITHOUT_GPU();
  std::mt19937 rng(29);
  // Small heads (their own value loop), 64 and 128.
  for (int hd : {32, 64, 128}) {
    const int nh = 8, nkv = 2, bt = 16, max_blocks = 1260, seqs = 2, pool_blocks = seqs * max_blocks + 3;
    INFO("head_dim " << hd);
    const auto kpool = round_bf16(randn(size_t(pool_blocks) * bt * nkv * hd, rng));
    const auto vpool = round_bf16(randn(kpool.size(), rng));
    const std::vector<int32_t> perm = shuffled_blocks(pool_blocks, rng);
    const std::vector<int32_t> tables(perm.begin(), perm.begin() + seqs * max_blocks);
    // Decode queries of 5,200 keys (10 runs; 4 where 4 is the most),
    // 1,031 (2 runs, the second not a whole tile), 1,023 (one: under two
    // runs' worth) and 20,000 (16: the cap; 4 of 5,000).
    const std::vector<int32_t> seq = {0, 1, 0, 1}, pos = {5199, 1030, 1022, 19999};
    CHECK(paged_attention_error(AttentionShape{hd, nh, nkv, bt, max_blocks}, kpool, vpool, tables, seq, pos, rng) <
          8e-3);
  }
}

TEST_CASE("cuda paged attention with head_dim 16 and 32 matches the CPU", "[cuda][attention]") {
  SKIP_WITHOUT_GPU();
  std::mt19937 rng(23);
  struct Shape {
    int hd, nh, nkv, bt;
  };
  // The fixtures' heads (16: 4/2 and OLMoE's 4/4; 32: Qwen3-MoE's 4/2), an
  // 8-query group on one KV head, and 7-slot blocks.
  for (const Shape sh : {Shape{16, 4, 2, 16}, Shape{16, 4, 4, 7}, Shape{16, 8, 1, 16},
                         Shape{32, 4, 2, 16}, Shape{32, 6, 3, 7}, Shape{32, 8, 1, 16}}) {
    const int hd = sh.hd, nh = sh.nh, nkv = sh.nkv, bt = sh.bt;
    INFO("head_dim " << hd << ", heads " << nh << "/" << nkv << ", block_tokens " << bt);
    const int seqs = 4, max_blocks = (320 + bt - 1) / bt, pool_blocks = seqs * max_blocks + 3;
    const auto kpool = round_bf16(randn(size_t(pool_blocks) * bt * nkv * hd, rng));
    const auto vpool = round_bf16(randn(kpool.size(), rng));
    const std::vector<int32_t> perm = shuffled_blocks(pool_blocks, rng);
    // Four sequences over disjoint, shuffled blocks.
    const std::vector<int32_t> tables(perm.begin(), perm.begin() + seqs * max_blocks);
    // Decode: contexts 1, 301 (every warp over more than one 32-key tile)
    // and 34 (one key past a tile); prefill: 24 queries of sequence 3 at
    // positions 41..64. 27 tokens in all.
    std::vector<int32_t> seq = {0, 1, 2}, pos = {0, 300, 33};
    for (int i = 0; i < 24; ++i) {
      seq.push_back(3);
      pos.push_back(41 + i);
    }
    CHECK(paged_attention_error(AttentionShape{hd, nh, nkv, bt, max_blocks}, kpool, vpool, tables, seq, pos, rng) <
          8e-3);
  }
}

TEST_CASE("cuda paged attention over coded rows (int8, fp8) matches the CPU on the same codes",
          "[cuda][attention][kv]") {
  SKIP_WITHOUT_GPU();
  std::mt19937 rng(24);
  for (moe::KvDtype dt : {moe::KvDtype::int8, moe::KvDtype::fp8})
    for (const int hd : {16, 32, 64, 128, 256}) {
      const int nh = 8, nkv = 2, bt = 16, seqs = 3, max_blocks = 8, pool_blocks = seqs * max_blocks + 2;
      INFO((dt == moe::KvDtype::int8 ? "int8" : "fp8") << ", head_dim " << hd);
      const size_t rows = size_t(pool_blocks) * bt * nkv;
      std::vector<uint8_t> kc(rows * hd), vc(rows * hd);
      std::vector<float> ks(rows), vs(rows);
      for (size_t r = 0; r < rows; ++r) {
        const auto kr = randn(hd, rng, 1.5f), vr = randn(hd, rng);
        ks[r] = moe::kv_encode_row(dt, kr.data(), hd, kc.data() + r * hd);
        vs[r] = moe::kv_encode_row(dt, vr.data(), hd, vc.data() + r * hd);
      }
      const std::vector<int32_t> perm = shuffled_blocks(pool_blocks, rng);
      const std::vector<int32_t> tables(perm.begin(), perm.begin() + seqs * max_blocks);
      // Decode at contexts 1, 97 and 128; a prefill of 20 queries of sequence 2.
      std::vector<int32_t> seq = {0, 1, 2}, pos = {0, 96, 127};
      for (int i = 0; i < 20; ++i) {
        seq.push_back(2);
        pos.push_back(100 + i);
      }
      Dev<uint8_t> dkc(kc), dvc(vc);
      Dev<float> dks(ks), dvs(vs);
      Dev<int32_t> dtab(tables);
      const moe::cuda::PagedKvPool kv = coded_pool(dt, dkc, dvc, dks, dvs, dtab.p, max_blocks, bt, nkv, hd);
      const moe::cpu::PagedKv cpu{nullptr, nullptr, nullptr, bt, dt, kc.data(), vc.data(), ks.data(), vs.data()};
      CHECK(attention_error(AttentionShape{hd, nh, nkv, bt, max_blocks}, cpu, kv, tables, seq, pos, rng) < 8e-3);
    }
}

TEST_CASE("cuda qkv_rope_store writes coded rows (int8, fp8) as the CPU encodes them", "[cuda][rope][kv]") {
  SKIP_WITHOUT_GPU();
  std::mt19937 rng(25);
  for (moe::KvDtype dt : {moe::KvDtype::int8, moe::KvDtype::fp8})
    for (const int hd : {32, 128}) {
      INFO((dt == moe::KvDtype::int8 ? "int8" : "fp8") << ", head_dim " << hd);
      const int tokens = 6, nh = 4, nkv = 2, bt = 16, pool_blocks = 9, max_blocks = 4;
      const int width = (nh + 2 * nkv) * hd;
      const auto qkv = randn(size_t(tokens) * width, rng);
      const std::vector<int32_t> tables = {3, 0, 7, 1, 8, 2, 5, 4};
      const std::vector<int32_t> seq = {0, 0, 1, 1, 0, 1}, pos = {0, 17, 5, 63, 40, 6};
      const auto inv_freq = moe::cpu::rope_inv_freq_default(1e6f, hd);
      std::vector<float> ref = qkv;
      moe::cpu::rope_neox(ref.data(), width, hd, pos.data(), tokens, nh, hd, inv_freq.data());
      moe::cpu::rope_neox(ref.data() + nh * hd, width, hd, pos.data(), tokens, nkv, hd, inv_freq.data());
      const size_t rows = size_t(pool_blocks) * bt * nkv;
      Dev<float> dqkv(qkv), dfreq(inv_freq), dks(rows), dvs(rows);
      Dev<bf16> dq(size_t(tokens) * nh * hd);
      Dev<uint8_t> dkc(rows * hd), dvc(rows * hd);
      Dev<int32_t> dtab(tables), dseq(seq), dpos(pos);
      const moe::cuda::PagedKvPool kv = coded_pool(dt, dkc, dvc, dks, dvs, dtab.p, max_blocks, bt, nkv, hd);
      REQUIRE_OK(moe::cuda::qkv_rope_store(rope_args(dqkv.p, dpos.p, dseq.p, dfreq.p, tokens, nh, dq.p), kv, nullptr));
      const auto kc = dkc.get(), vc = dvc.get();
      const auto ks = dks.get(), vs = dvs.get();
      const auto& tab = moe::kv_code_table(dt);
      size_t same = 0, all = 0;
      for (int t = 0; t < tokens; ++t) {
        const size_t slot = size_t(tables[seq[t] * max_blocks + pos[t] / bt]) * bt + pos[t] % bt;
        for (int side = 0; side < 2; ++side)
          for (int h = 0; h < nkv; ++h) {
            const float* x = ref.data() + size_t(t) * width + (nh + side * nkv + h) * hd;
            std::vector<uint8_t> want(hd);
            const float ws = moe::kv_encode_row(dt, x, hd, want.data());
            const size_t row = slot * nkv + h;
            const float gs = (side ? vs : ks)[row];
            const uint8_t* got = (side ? vc : kc).data() + row * hd;
            CHECK(gs == Approx(ws).epsilon(1e-5));
            for (int i = 0; i < hd; ++i) {
              ++all;
              same += got[i] == want[size_t(i)];
              // A code may differ only where x sat within rounding of a half step.
              CHECK(std::fabs(tab[got[i]] * gs - tab[want[size_t(i)]] * ws) <=
                    (dt == moe::KvDtype::int8 ? 1.001f * ws : std::fabs(x[i]) / 8 + ws / 256));
            }
          }
      }
      INFO(same << " of " << all << " codes the same");
      CHECK(double(same) >= 0.99 * double(all));
    }
}

// Blocks holding every layer's rows, ids running down from the top of one
// buffer (docs/kv-islands-trade.md): the store and attention through
// PagedKvPool's block strides give what the per-layer pools give, bit for bit.
TEST_CASE("cuda store and attention with blocks laid apart and running down equal the per-layer pools",
          "[cuda][attention][rope][kv]") {
  SKIP_WITHOUT_GPU();
  std::mt19937 rng(26);
  const int hd = 128, nh = 8, nkv = 2, bt = 16, blocks = 10, layers = 3, layer = 1, max_blocks = 4, tokens = 9;
  const int width = (nh + 2 * nkv) * hd;
  const size_t part = size_t(bt) * nkv * hd, spart = size_t(bt) * nkv;  // one layer's K (or V) in a block
  const std::vector<int32_t> tables = {7, 2, 9, 0, 5, 1, 8, 3};        // 2 sequences
  const std::vector<int32_t> seq = {0, 0, 0, 1, 1, 0, 1, 1, 0}, pos = {0, 1, 17, 0, 40, 33, 41, 16, 50};
  const auto qkv = randn(size_t(tokens) * width, rng);
  const auto inv_freq = moe::cpu::rope_inv_freq_default(1e6f, hd);
  Dev<float> dqkv(qkv), dfreq(inv_freq);
  Dev<int32_t> dtab(tables), dseq(seq), dpos(pos);
  for (moe::KvDtype dt : {moe::KvDtype::bf16, moe::KvDtype::int8}) {
    INFO((dt == moe::KvDtype::bf16 ? "bf16" : "int8"));
    const bool coded = dt != moe::KvDtype::bf16;
    // Per-layer pools: [blocks, bt, nkv, hd] each.
    Dev<bf16> pk(blocks * part), pv(blocks * part), apart_k(size_t(blocks) * layers * 2 * part);
    Dev<uint8_t> ck(blocks * part), cv(blocks * part), apart_c(size_t(blocks) * layers * 2 * part);
    Dev<float> sk(blocks * spart), sv(blocks * spart), apart_s(size_t(blocks) * layers * 2 * spart);
    moe::cuda::PagedKvPool flat = kv_pool(pk.p, pv.p, dtab.p, max_blocks, bt, nkv, hd);
    moe::cuda::PagedKvPool laid = kv_pool(nullptr, nullptr, dtab.p, max_blocks, bt, nkv, hd);
    // Block b's layer-l K rows at top - b * stride + l * 2 parts, V one part after.
    const int64_t stride = int64_t(layers) * 2 * int64_t(part), sstride = int64_t(layers) * 2 * int64_t(spart);
    const size_t top = size_t(blocks - 1) * size_t(stride) + size_t(layer) * 2 * part;
    const size_t stop = size_t(blocks - 1) * size_t(sstride) + size_t(layer) * 2 * spart;
    laid.block_stride = -stride;
    laid.scale_block_stride = -sstride;
    if (coded) {
      flat = coded_pool(dt, ck, cv, sk, sv, dtab.p, max_blocks, bt, nkv, hd);
      laid.dtype = dt;
      laid.k_codes = apart_c.p + top;
      laid.v_codes = apart_c.p + top + part;
      laid.k_scales = apart_s.p + stop;
      laid.v_scales = apart_s.p + stop + spart;
    } else {
      laid.k = apart_k.p + top;
      laid.v = apart_k.p + top + part;
    }
    Dev<bf16> q1(size_t(tokens) * nh * hd), q2(q1.n), o1(q1.n), o2(q1.n);
    for (auto [kv, q] : {std::pair{&flat, &q1}, std::pair{&laid, &q2}}) {
      REQUIRE_OK(moe::cuda::qkv_rope_store(rope_args(dqkv.p, dpos.p, dseq.p, dfreq.p, tokens, nh, q->p), *kv, nullptr));
    }
    // Both walks of the queries (the tiles meet sequence 0's tokens in two
    // runs apart).
    for (const auto walk : {moe::cuda::AttentionWalk::per_query, moe::cuda::AttentionWalk::query_tiles}) {
      INFO((walk == moe::cuda::AttentionWalk::per_query ? "a block a query" : "query tiles"));
      for (auto [kv, q, o] : {std::tuple{&flat, &q1, &o1}, std::tuple{&laid, &q2, &o2}}) {
        moe::cuda::AttentionArgs a;
        a.q = q->p;
        a.seq_of_token = dseq.p;
        a.positions = dpos.p;
        a.tokens = tokens;
        a.n_heads = nh;
        a.scale = 0.09f;
        a.out = o->p;
        a.walk = walk;
        REQUIRE_OK(moe::cuda::paged_attention(a, *kv, nullptr));
      }
      const auto g1 = o1.get(), g2 = o2.get();
      CHECK(std::memcmp(g1.data(), g2.data(), g1.size() * sizeof(bf16)) == 0);
    }
    // Each stored row sits where the strides say.
    size_t compared = 0;
    if (coded) {
      const auto a = ck.get(), b = apart_c.get();
      const auto sa = sk.get(), sb = apart_s.get();
      for (int t = 0; t < tokens; ++t) {
        const int64_t blk = tables[size_t(seq[t] * max_blocks + pos[t] / bt)], in_blk = pos[t] % bt;
        for (int i = 0; i < nkv * hd; ++i, ++compared)
          CHECK(a[size_t(blk) * part + size_t(in_blk) * nkv * hd + i] ==
                b[size_t(int64_t(top) - blk * stride) + size_t(in_blk) * nkv * hd + i]);
        for (int h = 0; h < nkv; ++h)
          CHECK(sa[size_t(blk) * spart + size_t(in_blk) * nkv + h] ==
                sb[size_t(int64_t(stop) - blk * sstride) + size_t(in_blk) * nkv + h]);
      }
    } else {
      const auto a = pk.get(), b = apart_k.get();
      for (int t = 0; t < tokens; ++t) {
        const int64_t blk = tables[size_t(seq[t] * max_blocks + pos[t] / bt)], in_blk = pos[t] % bt;
        for (int i = 0; i < nkv * hd; ++i, ++compared)
          CHECK(std::memcmp(&a[size_t(blk) * part + size_t(in_blk) * nkv * hd + i],
                            &b[size_t(int64_t(top) - blk * stride) + size_t(in_blk) * nkv * hd + i], sizeof(bf16)) == 0);
      }
    }
    CHECK(compared == size_t(tokens) * nkv * hd);
  }
}

TEST_CASE("cuda paged attention refuses an unsupported head_dim", "[cuda][attention]") {
  SKIP_WITHOUT_GPU();
  Dev<bf16> buf(4096);
  Dev<int32_t> ints(std::vector<int32_t>{0, 0});
  moe::cuda::PagedKvPool kv;
  kv.k = kv.v = buf.p;
  kv.block_tables = ints.p;
  kv.max_blocks = 1;
  kv.block_tokens = 16;
  kv.n_kv = 1;
  moe::cuda::AttentionArgs a;
  a.q = a.out = buf.p;
  a.seq_of_token = a.positions = ints.p;
  a.tokens = 1;
  a.n_heads = 1;
  for (int hd : {8, 48, 96}) {
    kv.head_dim = hd;
    const auto st = moe::cuda::paged_attention(a, kv, nullptr);
    REQUIRE_FALSE(st.ok());
    CHECK(st.error().find("16, 32, 64, 128, 256") != std::string::npos);
  }
}

TEST_CASE("cuda sampling picks the CPU twin's token", "[cuda][sampling]") {
  SKIP_WITHOUT_GPU();
  std::mt19937 rng(19);
  struct Cfg {
    int vocab;
    float temperature, top_p, sd;
    int top_k;
  };
  const Cfg cfgs[] = {{151936, 0.f, 1.f, 3.f, 0},   {151936, 0.8f, 1.f, 3.f, 50}, {151936, 1.f, 0.9f, 6.f, 0},
                      {151936, 0.7f, 0.5f, 2.f, 200}, {1001, 1.f, 1.f, 1.f, 0},    {32, 1.f, 1.f, 1.f, 1}};
  for (const auto& c : cfgs) {
    INFO("vocab " << c.vocab << " T " << c.temperature << " top_p " << c.top_p << " top_k " << c.top_k);
    const int rows = 16;
    auto logits = randn(size_t(rows) * c.vocab, rng, c.sd);
    logits[5] = logits[7] = 1e3f;  // a tie at the top of row 0: the lower id wins
    std::vector<moe::SampleDraw> params(rows);
    std::vector<int64_t> positions(rows);
    std::vector<int32_t> ref(rows);
    for (int r = 0; r < rows; ++r) {
      params[r] = {c.temperature, c.top_p, c.top_k, uint64_t(1000 + r)};
      positions[r] = 3 * r + 1;
      ref[r] = moe::cpu::sample_token(logits.data() + size_t(r) * c.vocab, c.vocab, params[r], positions[r]);
    }
    Dev<float> dl(logits);
    Dev<moe::SampleDraw> dp(params);
    Dev<int64_t> dpos(positions);
    Dev<int32_t> dt(rows);
    REQUIRE_OK(moe::cuda::sample_tokens(dl.p, rows, c.vocab, dp.p, dpos.p, dt.p, nullptr));
    CHECK(dt.get() == ref);
    if (c.temperature <= 0.f) {
      REQUIRE_OK(moe::cuda::argmax_tokens(dl.p, rows, c.vocab, dt.p, nullptr));
      CHECK(dt.get() == ref);
      CHECK(ref[0] == 5);
    }
  }
}

TEST_CASE("cuda token adjustments and min_p match the CPU twin", "[cuda][sampling]") {
  SKIP_WITHOUT_GPU();
  std::mt19937 rng(23);
  const int rows = 12, vocab = 151936;
  auto logits = randn(size_t(rows) * vocab, rng, 3.f);
  // Row r: 0, 1, ... 2000 distinct sorted tokens with counts, prompt flags,
  // biases and bans; row 3 none at all.
  std::vector<moe::AdjustSpan> spans(rows);
  std::vector<moe::TokenAdjust> entries;
  std::uniform_int_distribution<int> gap(1, 60), cnt(0, 4), coin(0, 1);
  for (int r = 0; r < rows; ++r) {
    spans[r].first = uint32_t(entries.size());
    spans[r].penalties = {1.0f + 0.1f * float(r % 4), 0.2f * float(r % 3), 0.15f * float(r % 5)};
    const int n = r == 3 ? 0 : (r * 173) % 2001;
    int32_t t = 0;
    for (int i = 0; i < n && t + 60 < vocab; ++i) {
      t += gap(rng);
      moe::TokenAdjust a{t, 0.0f, uint16_t(cnt(rng)), uint8_t(coin(rng))};
      if (i % 7 == 0) a.bias = float(gap(rng)) - 30.0f;
      if (i % 97 == 5) a.bias = -std::numeric_limits<float>::infinity();
      entries.push_back(a);
    }
    spans[r].count = uint32_t(entries.size()) - spans[r].first;
  }
  // The best token of row 0 banned: the draw must go elsewhere.
  {
    const float* row0 = logits.data();
    const int32_t best = int32_t(std::max_element(row0, row0 + vocab) - row0);
    auto at = std::lower_bound(entries.begin(), entries.begin() + spans[0].count, best,
                               [](const moe::TokenAdjust& a, int32_t v) { return a.token < v; });
    if (at != entries.begin() + spans[0].count && at->token == best) {
      at->bias = -std::numeric_limits<float>::infinity();
    } else {
      entries.insert(at, {best, -std::numeric_limits<float>::infinity(), 0, 0});
      ++spans[0].count;
      for (int r = 1; r < rows; ++r) ++spans[r].first;
    }
  }
  std::vector<float> ref = logits;
  for (int r = 0; r < rows; ++r)
    moe::cpu::adjust_logits(ref.data() + size_t(r) * vocab, vocab,
                            std::span(entries.data() + spans[r].first, spans[r].count), spans[r].penalties);
  Dev<float> dl(logits), dsaved(std::max<size_t>(entries.size(), 1));
  Dev<moe::AdjustSpan> ds(spans);
  Dev<moe::TokenAdjust> de(entries);
  REQUIRE_OK(moe::cuda::adjust_logits(dl.p, rows, vocab, ds.p, de.p, dsaved.p, nullptr));
  {  // the same rule; a fused multiply-add on the device may round the last bit differently
    const auto got = dl.get();
    size_t off = 0;
    for (size_t i = 0; i < got.size(); ++i)
      if (got[i] != ref[i] && !(std::abs(got[i] - ref[i]) <= 1e-6f * std::max(1.f, std::abs(ref[i])))) ++off;
    CHECK(off == 0);
  }
  const auto saved = dsaved.get();
  for (int r = 0; r < rows; ++r)
    for (uint32_t e = spans[r].first; e < spans[r].first + spans[r].count; ++e)
      REQUIRE(saved[e] == logits[size_t(r) * vocab + size_t(entries[e].token)]);

  // Masks of allowed tokens on rows 1, 4 and 5 (a handful, a few hundred,
  // one); the draw reads them, the logits stay.
  const int words = (vocab + 31) / 32;
  std::vector<uint32_t> masks(size_t(rows) * size_t(words), 0u);
  std::mt19937 mrng(99);
  for (int r : {1, 4, 5}) {
    spans[size_t(r)].mask = uint32_t(r * words);
    const int n_allowed = r == 1 ? 5 : r == 4 ? 300 : 1;
    for (int k = 0; k < n_allowed; ++k) {
      const uint32_t t = mrng() % uint32_t(vocab);
      masks[size_t(r) * size_t(words) + t / 32] |= 1u << (t % 32);
    }
  }
  ds.put(spans);
  Dev<uint32_t> dm(masks);
  std::vector<float> masked = ref;
  for (int r : {1, 4, 5})
    moe::cpu::mask_logits(masked.data() + size_t(r) * vocab, vocab, masks.data() + size_t(r) * size_t(words));
  auto allowed = [&](int r, int32_t t) {
    return spans[size_t(r)].mask == moe::kNoMask || (masks[size_t(r) * size_t(words) + size_t(t) / 32] >> (t % 32) & 1u);
  };

  // The draw with min_p (alone, with top-k, with top-p) over the adjusted rows.
  struct Cfg {
    float temperature, top_p, min_p;
    int top_k;
  };
  for (const Cfg c : {Cfg{0.f, 1.f, 0.f, 0}, Cfg{1.f, 1.f, 0.05f, 0}, Cfg{0.7f, 1.f, 0.2f, 40}, Cfg{1.2f, 0.9f, 0.05f, 0},
                      Cfg{1.f, 1.f, 1.f, 0}}) {
    INFO("T " << c.temperature << " top_p " << c.top_p << " min_p " << c.min_p << " top_k " << c.top_k);
    std::vector<moe::SampleDraw> params(rows);
    std::vector<int64_t> positions(rows);
    std::vector<int32_t> want(rows);
    for (int r = 0; r < rows; ++r) {
      params[r] = {c.temperature, c.top_p, c.top_k, uint64_t(77 + r)};
      params[r].min_p = c.min_p;
      positions[r] = 5 * r + 2;
      want[r] = moe::cpu::sample_token(ref.data() + size_t(r) * vocab, vocab, params[r], positions[r]);
    }
    Dev<moe::SampleDraw> dp(params);
    Dev<int64_t> dpos(positions);
    Dev<int32_t> dt(rows);
    {  // without masks (spans of no mask): the adjusted rows
      std::vector<moe::AdjustSpan> unmasked = spans;
      for (auto& sp : unmasked) sp.mask = moe::kNoMask;
      Dev<moe::AdjustSpan> du(unmasked);
      REQUIRE_OK(moe::cuda::sample_tokens(dl.p, rows, vocab, dp.p, dpos.p, dt.p, nullptr, du.p, dm.p));
      CHECK(dt.get() == want);
      REQUIRE_OK(moe::cuda::sample_tokens(dl.p, rows, vocab, dp.p, dpos.p, dt.p, nullptr));
      CHECK(dt.get() == want);
    }
    const float* row0 = logits.data();
    CHECK(want[0] != int32_t(std::max_element(row0, row0 + vocab) - row0));
    // With masks: the CPU twin over -inf where the mask is clear, and only allowed tokens.
    std::vector<int32_t> want_masked(rows);
    for (int r = 0; r < rows; ++r)
      want_masked[size_t(r)] = moe::cpu::sample_token(masked.data() + size_t(r) * vocab, vocab, params[size_t(r)],
                                                      positions[size_t(r)]);
    REQUIRE_OK(moe::cuda::sample_tokens(dl.p, rows, vocab, dp.p, dpos.p, dt.p, nullptr, ds.p, dm.p));
    const auto got = dt.get();
    CHECK(got == want_masked);
    for (int r = 0; r < rows; ++r) CHECK(allowed(r, got[size_t(r)]));
  }
  {  // the draws never wrote the logits
    const auto after = dl.get();
    size_t off = 0;
    for (size_t i = 0; i < after.size(); ++i)
      if (after[i] != ref[i] && !(std::abs(after[i] - ref[i]) <= 1e-6f * std::max(1.f, std::abs(ref[i])))) ++off;
    CHECK(off == 0);
  }
}

TEST_CASE("cuda bf16 dense layers (decode GEMV and cuBLASLt) match the CPU", "[cuda][dense]") {
  SKIP_WITHOUT_GPU();
  std::mt19937 rng(20);
  const int n_out = 77, k = 1000;
  const auto w = round_bf16(randn(size_t(n_out) * k, rng, 0.05f));
  const auto wbits = bf16_bits(w);
  Dev<bf16> dw(to_bf16(w));
  for (int tokens : {1, 3, 8}) {
    INFO("tokens " << tokens);
    const auto x = round_bf16(randn(size_t(tokens) * k, rng));
    const auto y0 = randn(size_t(tokens) * n_out, rng);
    const auto gate = randn(tokens, rng);
    std::vector<float> ref(y0.size());
    moe::cpu::matmul_bf16(x.data(), wbits.data(), nullptr, ref.data(), tokens, k, n_out, nullptr);
    Dev<bf16> dx(to_bf16(x));
    Dev<float> dy(y0.size()), dg(gate);
    REQUIRE_OK(moe::cuda::dense_gemv_bf16(dw.p, dx.p, dy.p, tokens, n_out, k, false, nullptr, 0, nullptr));
    CHECK(rel_err(dy.get(), ref) < 1e-5);
    // Gated accumulate (the shared expert's output onto the residual).
    dy.put(y0);
    REQUIRE_OK(moe::cuda::dense_gemv_bf16(dw.p, dx.p, dy.p, tokens, n_out, k, true, dg.p, 1, nullptr));
    std::vector<float> refg(y0.size());
    for (int t = 0; t < tokens; ++t)
      for (int n = 0; n < n_out; ++n)
        refg[size_t(t) * n_out + n] =
            y0[size_t(t) * n_out + n] + moe::cpu::sigmoid(gate[t]) * ref[size_t(t) * n_out + n];
    CHECK(rel_err(dy.get(), refg) < 1e-5);
  }
  CHECK_FALSE(moe::cuda::dense_gemv_bf16(dw.p, dw.p, nullptr, 9, n_out, k, false, nullptr, 0, nullptr).ok());

  // Input made while staging: RMSNorm of an f32 residual, or SiLU(gate) * up.
  for (int tokens : {1, 5}) {
    INFO("fused input, tokens " << tokens);
    const auto res = randn(size_t(tokens) * k, rng, 2.f);
    const auto nw = round_bf16(randn(k, rng));
    const auto xnb = rmsnorm_bf16(res, nw, tokens, k);
    std::vector<float> ref(size_t(tokens) * n_out);
    moe::cpu::matmul_bf16(xnb.data(), wbits.data(), nullptr, ref.data(), tokens, k, n_out, nullptr);
    Dev<float> dres(res), dy(ref.size());
    Dev<bf16> dnw(to_bf16(nw)), dxn(res.size());
    REQUIRE_OK(moe::cuda::dense_gemv_bf16_rmsnorm(dw.p, dres.p, dnw.p, 1e-6f, dxn.p, dy.p, tokens, n_out, k, false,
                                                  nullptr, 0, nullptr));
    CHECK(rel_err(dy.get(), ref) < 2e-3);
    CHECK(rel_err(as_float(dxn.get()), xnb) < 2e-3);

    const int stride = 2 * k + 3;
    const auto gu = randn(size_t(tokens) * stride, rng);
    const auto hb = silu_input_bf16(gu, tokens, k, stride);
    moe::cpu::matmul_bf16(hb.data(), wbits.data(), nullptr, ref.data(), tokens, k, n_out, nullptr);
    Dev<float> dgu(gu);
    REQUIRE_OK(moe::cuda::dense_gemv_bf16_silu(dw.p, dgu.p, stride, dy.p, tokens, n_out, k, false, nullptr, 0,
                                               nullptr));
    CHECK(rel_err(dy.get(), ref) < 2e-3);
  }

  auto mm = moe::cuda::CublasLtMatmul::create();
  REQUIRE(mm.ok());
  std::unique_ptr<moe::cuda::CublasLtMatmul> owner(mm.value());
  const int m = 37;
  const auto x = round_bf16(randn(size_t(m) * k, rng));
  std::vector<float> ref(size_t(m) * n_out);
  moe::cpu::matmul_bf16(x.data(), wbits.data(), nullptr, ref.data(), m, k, n_out, nullptr);
  Dev<bf16> dx(to_bf16(x)), dyb(ref.size());
  Dev<float> dy(ref.size());
  REQUIRE_OK(owner->matmul(dx.p, dw.p, dy.p, true, m, n_out, k, 0.f, nullptr));
  CHECK(rel_err(dy.get(), ref) < 1e-4);
  REQUIRE_OK(owner->matmul(dx.p, dw.p, dyb.p, false, m, n_out, k, 0.f, nullptr));
  CHECK(rel_err(as_float(dyb.get()), ref) < 8e-3);
  // beta = 1 accumulates.
  REQUIRE_OK(owner->matmul(dx.p, dw.p, dy.p, true, m, n_out, k, 1.f, nullptr));
  std::vector<float> twice = ref;
  for (auto& v : twice) v *= 2.f;
  CHECK(rel_err(dy.get(), twice) < 1e-4);
}

TEST_CASE("cuda embedding_gather and gated_add", "[cuda][activation]") {
  SKIP_WITHOUT_GPU();
  std::mt19937 rng(21);
  const int vocab = 37, hidden = 129;
  const auto table = round_bf16(randn(size_t(vocab) * hidden, rng));
  const std::vector<int32_t> ids = {5, 0, 36, -1, 37};  // the last two are out of range: zero rows
  Dev<bf16> dtab(to_bf16(table));
  Dev<int32_t> dids(ids);
  Dev<float> dx(ids.size() * hidden);
  REQUIRE_OK(moe::cuda::embedding_gather(dtab.p, vocab, hidden, dids.p, int(ids.size()), dx.p, nullptr));
  const auto x = dx.get();
  for (size_t t = 0; t < ids.size(); ++t)
    for (int i = 0; i < hidden; ++i) {
      const float want = ids[t] >= 0 && ids[t] < vocab ? table[size_t(ids[t]) * hidden + i] : 0.f;
      REQUIRE(x[t * hidden + i] == want);
    }
  const int rows = 3;
  const auto base = randn(size_t(rows) * hidden, rng), y = randn(base.size(), rng), g = randn(rows * 2, rng);
  std::vector<float> ref = base;
  for (int r = 0; r < rows; ++r)
    for (int i = 0; i < hidden; ++i) ref[size_t(r) * hidden + i] += moe::cpu::sigmoid(g[r * 2]) * y[size_t(r) * hidden + i];
  Dev<float> db(base), dy(y), dg(g);
  REQUIRE_OK(moe::cuda::gated_add(db.p, dy.p, dg.p, 2, rows, hidden, nullptr));
  CHECK(rel_err(db.get(), ref) < 1e-6);
}

namespace {

// The INT8 row rule on the host: scale = max |w| / 127, q = w / scale rounded
// to nearest (ties to even), clamped to [-127, 127]; an all-zero row gets 0.
void quantize_rows_host(const std::vector<float>& w, int n_out, int k, std::vector<int8_t>& q,
                        std::vector<float>& scale) {
  q.assign(size_t(n_out) * k, 0);
  scale.assign(n_out, 0.f);
  for (int n = 0; n < n_out; ++n) {
    const float* row = w.data() + size_t(n) * k;
    float m = 0.f;
    for (int i = 0; i < k; ++i) m = std::max(m, std::fabs(row[i]));
    const float s = m / 127.f;
    scale[n] = s;
    for (int i = 0; i < k; ++i) {
      const float v = s > 0.f ? std::nearbyint(row[i] / s) : 0.f;
      q[size_t(n) * k + i] = int8_t(std::min(std::max(v, -127.f), 127.f));
    }
  }
}

std::vector<float> dequantize_rows_host(const std::vector<int8_t>& q, const std::vector<float>& scale, int k) {
  std::vector<float> w(q.size());
  for (size_t i = 0; i < q.size(); ++i) w[i] = scale[i / k] * float(q[i]);
  return w;
}

// y0 + sigmoid(gate[t * stride]) * r (gated), or r.
std::vector<float> gated_ref(const std::vector<float>& r, const std::vector<float>& y0, const float* gate,
                             int stride, bool accumulate, int tokens, int n_out) {
  std::vector<float> o(r.size());
  for (int t = 0; t < tokens; ++t)
    for (int n = 0; n < n_out; ++n) {
      const size_t i = size_t(t) * n_out + n;
      const float v = gate ? moe::cpu::sigmoid(gate[size_t(t) * stride]) * r[i] : r[i];
      o[i] = accumulate ? y0[i] + v : v;
    }
  return o;
}

}  // namespace

TEST_CASE("cuda int8 row quantisation (quantize_rows_i8, dequantize_rows_i8) follows the host rule",
          "[cuda][dense][int8]") {
  SKIP_WITHOUT_GPU();
  std::mt19937 rng(30);
  // k 1000 dequantises 8 weights a thread; k 13 one at a time.
  for (auto [n_out, k] : {std::pair{37, 1000}, std::pair{5, 13}, std::pair{3, 48}}) {
    INFO("n_out " << n_out << ", k " << k);
    auto w = round_bf16(randn(size_t(n_out) * k, rng, 0.05f));
    for (int i = 0; i < k; ++i) w[size_t(1) * k + i] = 0.f;  // an all-zero row
    w[size_t(2) * k + k / 2] = 3.f;                            // an outlier sets its row's scale
    std::vector<int8_t> qh;
    std::vector<float> sh;
    quantize_rows_host(w, n_out, k, qh, sh);
    Dev<bf16> dw(to_bf16(w));
    Dev<int8_t> dq(w.size());
    Dev<float> ds(n_out);
    REQUIRE_OK(moe::cuda::quantize_rows_i8(dw.p, n_out, k, dq.p, ds.p, nullptr));
    const auto q = dq.get();
    const auto s = ds.get();
    CHECK(s == sh);
    CHECK(q == qh);
    CHECK(s[1] == 0.f);
    CHECK(s[2] == 3.f / 127.f);

    Dev<bf16> dout(w.size());
    REQUIRE_OK(moe::cuda::dequantize_rows_i8(dq.p, ds.p, n_out, k, dout.p, nullptr));
    const auto out = as_float(dout.get());
    const auto deq = dequantize_rows_host(q, s, k);  // f32 scale * q
    size_t bad_f32 = 0, bad_bf16 = 0, not_exact = 0;
    for (size_t i = 0; i < w.size(); ++i) {
      const float sc = s[i / k];
      // Rounding to nearest leaves at most half a step (plus the f32
      // division's rounding).
      if (std::fabs(deq[i] - w[i]) > 0.5f * sc * (1.f + 1e-5f)) ++bad_f32;
      // The bf16 output adds its own rounding (at most 2^-8 relative).
      if (std::fabs(out[i] - w[i]) > 0.5f * sc * (1.f + 1e-5f) + std::ldexp(std::fabs(deq[i]), -8)) ++bad_bf16;
      if (out[i] != from_bf16(to_bf16(deq[i]))) ++not_exact;
    }
    CHECK(bad_f32 == 0);
    CHECK(bad_bf16 == 0);
    CHECK(not_exact == 0);
  }
  // The scalar dequantiser also serves a misaligned output.
  {
    const int n_out = 4, k = 16;
    const auto w = round_bf16(randn(size_t(n_out) * k, rng));
    std::vector<int8_t> qh;
    std::vector<float> sh;
    quantize_rows_host(w, n_out, k, qh, sh);
    Dev<int8_t> dq(qh);
    Dev<float> ds(sh);
    Dev<bf16> dout(w.size() + 1);
    REQUIRE_OK(moe::cuda::dequantize_rows_i8(dq.p, ds.p, n_out, k, dout.p + 1, nullptr));
    const auto out = as_float(dout.get());
    const auto deq = dequantize_rows_host(qh, sh, k);
    for (size_t i = 0; i < w.size(); ++i) REQUIRE(out[i + 1] == from_bf16(to_bf16(deq[i])));
  }
  Dev<bf16> dw(16);
  Dev<int8_t> dq(16);
  Dev<float> ds(1);
  CHECK_FALSE(moe::cuda::quantize_rows_i8(dw.p, 0, 16, dq.p, ds.p, nullptr).ok());
  CHECK_FALSE(moe::cuda::quantize_rows_i8(dw.p, 1, 16, nullptr, ds.p, nullptr).ok());
  CHECK_FALSE(moe::cuda::dequantize_rows_i8(dq.p, nullptr, 1, 16, dw.p, nullptr).ok());
  CHECK_FALSE(moe::cuda::dequantize_rows_i8(dq.p, ds.p, 1, 0, dw.p, nullptr).ok());
}

TEST_CASE("cuda int8 dense GEMVs (bf16, rmsnorm and silu inputs) match the CPU", "[cuda][dense][int8]") {
  SKIP_WITHOUT_GPU();
  std::mt19937 rng(31);
  // Against the dequantised weights (f32 scale * q) the only difference is
  // f32 summation order: 1e-5. Against the original bf16 weights the INT8
  // rounding shows: each weight moves by up to half a step of max|row| / 127,
  // about 0.7% of the weights' RMS for these Gaussian rows, hence 1.5e-2.
  constexpr double kTight = 1e-5, kLoose = 1.5e-2;
  // k = 16 m: one run, 37 runs (a partial second half-round), 133 runs
  // (three rounds, the last partial); n_out not a multiple of 16. k a
  // multiple of 64 takes the tensor-core kernel from 5 tokens on: 16 chunks
  // (two per warp), 88 (eleven a warp, three load groups).
  for (auto [n_out, k] : {std::pair{77, 2128}, std::pair{5, 16}, std::pair{130, 592}, std::pair{45, 1024},
                          std::pair{33, 5632}}) {
    INFO("n_out " << n_out << ", k " << k);
    const auto w = round_bf16(randn(size_t(n_out) * k, rng, 0.05f));
    const auto wbits = bf16_bits(w);
    Dev<bf16> dwb(to_bf16(w));
    Dev<int8_t> dq(w.size());
    Dev<float> ds(n_out);
    REQUIRE_OK(moe::cuda::quantize_rows_i8(dwb.p, n_out, k, dq.p, ds.p, nullptr));
    const auto wdq = dequantize_rows_host(dq.get(), ds.get(), k);

    for (int tokens = 1; tokens <= moe::cuda::kGemvMaxTokens; ++tokens) {
      const auto x = round_bf16(randn(size_t(tokens) * k, rng));
      const auto y0 = randn(size_t(tokens) * n_out, rng);
      const auto gate = randn(size_t(tokens) * 2, rng);
      std::vector<float> ref(y0.size()), ref16(y0.size());
      moe::cpu::matmul_f32(x.data(), wdq.data(), nullptr, ref.data(), tokens, k, n_out, nullptr);
      moe::cpu::matmul_bf16(x.data(), wbits.data(), nullptr, ref16.data(), tokens, k, n_out, nullptr);
      Dev<bf16> dx(to_bf16(x));
      Dev<float> dy(y0.size()), dg(gate);
      for (int mode = 0; mode < 4; ++mode) {
        const bool accumulate = mode & 1, gated = mode & 2;
        INFO("tokens " << tokens << ", accumulate " << accumulate << ", gate " << gated);
        dy.put(y0);
        REQUIRE_OK(moe::cuda::dense_gemv_i8(dq.p, ds.p, dx.p, dy.p, tokens, n_out, k, accumulate,
                                            gated ? dg.p : nullptr, 2, nullptr));
        const auto y = dy.get();
        const float* g = gated ? gate.data() : nullptr;
        CHECK(rel_err(y, gated_ref(ref, y0, g, 2, accumulate, tokens, n_out)) < kTight);
        // Only the freshly written part: accumulating onto y0 would hide it.
        if (!accumulate) CHECK(rel_err(y, gated_ref(ref16, y0, g, 2, false, tokens, n_out)) < kLoose);
      }
    }

    // RMSNorm input: the kernel's own normed input (xn_out) gives the tight
    // reference; the CPU's RMSNorm differs only by bf16 rounding flips.
    for (int tokens : {1, 4, 8}) {
      INFO("rmsnorm input, tokens " << tokens);
      const auto [res, nw, y0, gate, xnb] = norm_input_case(tokens, k, n_out, rng);
      Dev<float> dres(res), dy(y0.size()), dg(gate);
      Dev<bf16> dnw(to_bf16(nw)), dxn(res.size());
      REQUIRE_OK(moe::cuda::dense_gemv_i8_rmsnorm(dq.p, ds.p, dres.p, dnw.p, 1e-6f, dxn.p, dy.p, tokens, n_out, k,
                                                  false, nullptr, 0, nullptr));
      const auto xg = as_float(dxn.get());
      CHECK(rel_err(xg, xnb) < 2e-3);
      std::vector<float> ref(y0.size()), ref16(y0.size());
      moe::cpu::matmul_f32(xg.data(), wdq.data(), nullptr, ref.data(), tokens, k, n_out, nullptr);
      moe::cpu::matmul_bf16(xnb.data(), wbits.data(), nullptr, ref16.data(), tokens, k, n_out, nullptr);
      CHECK(rel_err(dy.get(), ref) < kTight);
      CHECK(rel_err(dy.get(), ref16) < kLoose);
      // Gated accumulate, without the normed-input copy.
      dy.put(y0);
      REQUIRE_OK(moe::cuda::dense_gemv_i8_rmsnorm(dq.p, ds.p, dres.p, dnw.p, 1e-6f, nullptr, dy.p, tokens, n_out,
                                                  k, true, dg.p, 1, nullptr));
      CHECK(rel_err(dy.get(), gated_ref(ref, y0, gate.data(), 1, true, tokens, n_out)) < kTight);
    }

    // SiLU(gate) * up input: the CPU makes it, so bf16 rounding flips set the
    // tight bound (as for the bf16 GEMV).
    for (int tokens : {1, 3, 8}) {
      INFO("silu input, tokens " << tokens);
      const auto [stride, gu, y0, gate, hb] = silu_input_case(tokens, k, n_out, rng);
      std::vector<float> ref(y0.size()), ref16(y0.size());
      moe::cpu::matmul_f32(hb.data(), wdq.data(), nullptr, ref.data(), tokens, k, n_out, nullptr);
      moe::cpu::matmul_bf16(hb.data(), wbits.data(), nullptr, ref16.data(), tokens, k, n_out, nullptr);
      Dev<float> dgu(gu), dy(y0.size()), dg(gate);
      REQUIRE_OK(moe::cuda::dense_gemv_i8_silu(dq.p, ds.p, dgu.p, stride, dy.p, tokens, n_out, k, false, nullptr,
                                               0, nullptr));
      CHECK(rel_err(dy.get(), ref) < 2e-3);
      CHECK(rel_err(dy.get(), ref16) < kLoose);
      dy.put(y0);
      REQUIRE_OK(moe::cuda::dense_gemv_i8_silu(dq.p, ds.p, dgu.p, stride, dy.p, tokens, n_out, k, true, dg.p, 1,
                                               nullptr));
      CHECK(rel_err(dy.get(), gated_ref(ref, y0, gate.data(), 1, true, tokens, n_out)) < 2e-3);
    }
  }

  // Refusals: k not a multiple of 16, no scales, too many tokens, a
  // misaligned weight pointer.
  Dev<int8_t> dq(64 * 24);
  Dev<float> ds(64), dy(8 * 64);
  Dev<bf16> dx(9 * 32);
  CHECK_FALSE(moe::cuda::dense_gemv_i8(dq.p, ds.p, dx.p, dy.p, 1, 64, 24, false, nullptr, 0, nullptr).ok());
  CHECK_FALSE(moe::cuda::dense_gemv_i8(dq.p, nullptr, dx.p, dy.p, 1, 64, 16, false, nullptr, 0, nullptr).ok());
  CHECK_FALSE(moe::cuda::dense_gemv_i8(dq.p, ds.p, dx.p, dy.p, 9, 64, 16, false, nullptr, 0, nullptr).ok());
  CHECK_FALSE(moe::cuda::dense_gemv_i8(dq.p + 8, ds.p, dx.p, dy.p, 1, 64, 16, false, nullptr, 0, nullptr).ok());
}

namespace {

// A bf16 matrix quantised on the host as the engine does at load (one INT4
// matrix of its own, groups of 64 or the width's), with its f32 dequantised
// twin.
struct HostQ4 {
  moe::Q4MatrixLayout m;
  std::vector<uint8_t> blob;
  std::vector<float> wdq;  // [rows, cols]
};
HostQ4 quantize_q4(const std::vector<float>& w, int rows, int cols) {
  HostQ4 h;
  h.m = moe::q4_matrix_layout(rows, cols, 64);
  h.blob.assign(moe::q4_matrix_bytes(h.m), 0);
  moe::q4_quantize_matrix(w.data(), h.m, h.blob.data());
  h.wdq.resize(w.size());
  for (int r = 0; r < rows; ++r) moe::q4_dequantize_row(h.blob.data(), h.m, r, h.wdq.data() + size_t(r) * cols);
  return h;
}

}  // namespace

TEST_CASE("cuda INT4 dense GEMVs (bf16, rmsnorm and silu inputs) and dequantisation match the CPU",
          "[cuda][dense][int4]") {
  SKIP_WITHOUT_GPU();
  std::mt19937 rng(32);
  // Against the dequantised weights the kernel's half2 chunk sums (inputs
  // scaled to |x| <= 1 per 32, as the expert GEMVs) leave ~1e-3 relative:
  // 3e-3. Against the original weights INT4's own rounding shows: a weight
  // moves by up to half a step of its group's range / 15, ~9 % of the
  // weights' RMS for Gaussian groups of 64, more on the smallest shapes,
  // hence 0.25 (and a check that it is not far smaller, so the comparison
  // really is against the original weights).
  constexpr double kTight = 3e-3, kLoose = 0.25;
  // k = 32: one run, group 32; 160: group 32, five runs; 2048 and 5632:
  // groups of 64 over rounds of 64 runs, the last partial; n_out odd.
  for (auto [n_out, k] : {std::pair{77, 2048}, std::pair{5, 32}, std::pair{130, 160}, std::pair{33, 5632}}) {
    INFO("n_out " << n_out << ", k " << k);
    const auto w = round_bf16(randn(size_t(n_out) * k, rng, 0.05f));
    const HostQ4 q = quantize_q4(w, n_out, k);
    CHECK(q.m.group == (k % 64 == 0 ? 64 : 32));
    Dev<uint8_t> dblob(q.blob);

    // Dequantisation for the prefill path: bf16 of the f32 dequantised weight.
    {
      Dev<bf16> dout(w.size());
      REQUIRE_OK(moe::cuda::dequantize_q4(dblob.p, q.m, dout.p, nullptr));
      const auto out = as_float(dout.get());
      size_t not_exact = 0;
      for (size_t i = 0; i < w.size(); ++i)
        if (out[i] != from_bf16(to_bf16(q.wdq[i]))) ++not_exact;
      CHECK(not_exact == 0);
    }

    for (int tokens = 1; tokens <= moe::cuda::kGemvMaxTokens; ++tokens) {
      const auto x = round_bf16(randn(size_t(tokens) * k, rng));
      const auto y0 = randn(size_t(tokens) * n_out, rng);
      const auto gate = randn(size_t(tokens) * 2, rng);
      std::vector<float> ref(y0.size()), ref_w(y0.size());
      moe::cpu::matmul_f32(x.data(), q.wdq.data(), nullptr, ref.data(), tokens, k, n_out, nullptr);
      moe::cpu::matmul_f32(x.data(), w.data(), nullptr, ref_w.data(), tokens, k, n_out, nullptr);
      Dev<bf16> dx(to_bf16(x));
      Dev<float> dy(y0.size()), dg(gate);
      for (int mode = 0; mode < 4; ++mode) {
        const bool accumulate = mode & 1, gated = mode & 2;
        INFO("tokens " << tokens << ", accumulate " << accumulate << ", gate " << gated);
        dy.put(y0);
        REQUIRE_OK(moe::cuda::dense_gemv_q4(dblob.p, q.m, dx.p, dy.p, tokens, accumulate, gated ? dg.p : nullptr, 2,
                                            nullptr));
        const auto y = dy.get();
        const float* g = gated ? gate.data() : nullptr;
        CHECK(rel_err(y, gated_ref(ref, y0, g, 2, accumulate, tokens, n_out)) < kTight);
        if (!accumulate) {
          const double e = rel_err(y, gated_ref(ref_w, y0, g, 2, false, tokens, n_out));
          CHECK(e < kLoose);
          CHECK(e > 0.01);
        }
      }
    }

    // RMSNorm input, checked against the kernel's own normed input.
    for (int tokens : {1, 4, 8}) {
      INFO("rmsnorm input, tokens " << tokens);
      const auto [res, nw, y0, gate, xnb] = norm_input_case(tokens, k, n_out, rng);
      Dev<float> dres(res), dy(y0.size()), dg(gate);
      Dev<bf16> dnw(to_bf16(nw)), dxn(res.size());
      REQUIRE_OK(moe::cuda::dense_gemv_q4_rmsnorm(dblob.p, q.m, dres.p, dnw.p, 1e-6f, dxn.p, dy.p, tokens, false,
                                                  nullptr, 0, nullptr));
      const auto xg = as_float(dxn.get());
      CHECK(rel_err(xg, xnb) < 2e-3);
      std::vector<float> ref(y0.size());
      moe::cpu::matmul_f32(xg.data(), q.wdq.data(), nullptr, ref.data(), tokens, k, n_out, nullptr);
      CHECK(rel_err(dy.get(), ref) < kTight);
      dy.put(y0);
      REQUIRE_OK(moe::cuda::dense_gemv_q4_rmsnorm(dblob.p, q.m, dres.p, dnw.p, 1e-6f, nullptr, dy.p, tokens, true,
                                                  dg.p, 1, nullptr));
      CHECK(rel_err(dy.get(), gated_ref(ref, y0, gate.data(), 1, true, tokens, n_out)) < kTight);
    }

    // SiLU(gate) * up input: the CPU makes it, so bf16 rounding flips set the bound.
    for (int tokens : {1, 3, 8}) {
      INFO("silu input, tokens " << tokens);
      const auto [stride, gu, y0, gate, hb] = silu_input_case(tokens, k, n_out, rng);
      std::vector<float> ref(y0.size());
      moe::cpu::matmul_f32(hb.data(), q.wdq.data(), nullptr, ref.data(), tokens, k, n_out, nullptr);
      Dev<float> dgu(gu), dy(y0.size()), dg(gate);
      dy.put(y0);
      REQUIRE_OK(moe::cuda::dense_gemv_q4_silu(dblob.p, q.m, dgu.p, stride, dy.p, tokens, true, dg.p, 1, nullptr));
      CHECK(rel_err(dy.get(), gated_ref(ref, y0, gate.data(), 1, true, tokens, n_out)) < kTight);
    }

    // A slice of rows (the engine's router / shared-expert views) reads the same rows.
    if (n_out > 3) {
      const moe::Q4MatrixLayout s = moe::q4_row_slice(q.m, 2, n_out - 3);
      const auto x = round_bf16(randn(size_t(k), rng));
      Dev<bf16> dx(to_bf16(x));
      Dev<float> dy(size_t(n_out - 3));
      REQUIRE_OK(moe::cuda::dense_gemv_q4(dblob.p, s, dx.p, dy.p, 1, false, nullptr, 0, nullptr));
      std::vector<float> ref(size_t(n_out - 3));
      moe::cpu::matmul_f32(x.data(), q.wdq.data() + size_t(2) * k, nullptr, ref.data(), 1, k, n_out - 3, nullptr);
      CHECK(rel_err(dy.get(), ref) < kTight);
    }
  }

  // Refusals: a width not a multiple of 32, groups below 32, too many tokens.
  Dev<uint8_t> dblob(1 << 16);
  Dev<float> dy(8 * 64);
  Dev<bf16> dx(9 * 96), dout(64 * 96);
  const moe::Q4MatrixLayout narrow = moe::q4_matrix_layout(4, 48, 64);  // group 16
  CHECK_FALSE(moe::cuda::dense_gemv_q4(dblob.p, narrow, dx.p, dy.p, 1, false, nullptr, 0, nullptr).ok());
  CHECK_FALSE(moe::cuda::dequantize_q4(dblob.p, narrow, dout.p, nullptr).ok());
  const moe::Q4MatrixLayout ok = moe::q4_matrix_layout(4, 64, 64);
  CHECK_FALSE(moe::cuda::dense_gemv_q4(dblob.p, ok, dx.p, dy.p, 9, false, nullptr, 0, nullptr).ok());
  CHECK_FALSE(moe::cuda::dense_gemv_q4(nullptr, ok, dx.p, dy.p, 1, false, nullptr, 0, nullptr).ok());
  CHECK(moe::cuda::dense_gemv_q4(dblob.p, ok, dx.p, dy.p, 1, false, nullptr, 0, nullptr).ok());
}

// Latent attention (kernels/cuda/mla.cuh), absorbed on the GPU, against the
// expanded form on the CPU (ForwardPass::attention_mla's: K and V made from
// the latent through kv_b_proj, then cpu::attention). One sequence of C
// tokens, stored in scattered blocks and attended causally in one call, so
// every context from 1 to C and every tile boundary is met; the rows the
// store wrote are checked against the CPU's latent and rotated key too.
// YaRN RoPE with a cos/sin factor other than 1. Both sides read the same
// bf16-rounded weights; the GPU rounds the latent rows, the query parts and
// the latent output to bf16, hence the bound.
TEST_CASE("cuda latent attention (store, W_UK and W_UV per head, paged latent rows) matches expanded attention",
          "[cuda][mla]") {
  SKIP_WITHOUT_GPU();
  struct Shape {
    int rank, rope, nh, nope, vd, context;
  };
  // 6 heads: a head a block in the long pass too (4 a block needs a multiple of 4).
  for (const Shape sh : {Shape{32, 8, 4, 16, 16, 37}, Shape{32, 8, 4, 16, 16, 300}, Shape{32, 8, 6, 16, 16, 40},
                         Shape{512, 64, 16, 128, 128, 17}, Shape{512, 64, 16, 128, 128, 1100}}) {
    INFO("rank " << sh.rank << ", rope " << sh.rope << ", heads " << sh.nh << ", context " << sh.context);
    std::mt19937 rng(uint32_t(91 + sh.context + sh.rank));
    const int R = sh.rank, P = sh.rope, nh = sh.nh, nope = sh.nope, vd = sh.vd, C = sh.context, qk = nope + P,
              W = R + P, bt = 16;
    const int row_stride = nh * qk + W + 8;  // a gap after kv_a, as a wider first projection leaves
    const auto proj = randn(size_t(C) * row_stride, rng);
    const auto kv_norm = round_bf16(randn(R, rng, 0.2f));
    std::vector<float> norm_w(kv_norm);
    for (float& v : norm_w) v += 1.f;
    norm_w = round_bf16(norm_w);
    const auto kv_b = round_bf16(randn(size_t(nh) * (nope + vd) * R, rng, 1.f / std::sqrt(float(R))));
    float factor = 1.f;
    const auto inv_freq = moe::cpu::rope_inv_freq_yarn(1e4f, P, 40.f, 4096, 32.f, 1.f, 1.f, 0.f, &factor);
    REQUIRE(factor != 1.f);
    const float scale = 1.f / std::sqrt(float(qk));
    std::vector<int32_t> pos(static_cast<size_t>(C)), seq(static_cast<size_t>(C), 0);
    std::iota(pos.begin(), pos.end(), 0);
    const int blocks = (C + bt - 1) / bt;
    std::vector<int32_t> table(static_cast<size_t>(blocks));
    for (int b = 0; b < blocks; ++b) table[size_t(b)] = (b * 7 + 3) % blocks;  // scattered (7 and blocks coprime below)
    REQUIRE(std::set<int32_t>(table.begin(), table.end()).size() == size_t(blocks));

    // The CPU: latent and rotated key, expanded K and V, attention.
    std::vector<float> lat(size_t(C) * W), q(size_t(C) * nh * qk);
    for (int t = 0; t < C; ++t) {
      const float* row = proj.data() + size_t(t) * row_stride;
      std::copy(row, row + nh * qk, q.begin() + size_t(t) * nh * qk);
      std::copy(row + nh * qk + R, row + nh * qk + W, lat.begin() + size_t(t) * W + R);
      moe::cpu::rmsnorm(row + nh * qk, R, norm_w.data(), lat.data() + size_t(t) * W, W, 1, R, 1e-6f);
    }
    moe::cpu::rope_interleaved(lat.data() + R, W, 0, pos.data(), C, 1, P, inv_freq.data(), factor);
    moe::cpu::rope_interleaved(q.data() + nope, nh * qk, qk, pos.data(), C, nh, P, inv_freq.data(), factor);
    std::vector<float> K(size_t(C) * nh * qk), V(size_t(C) * nh * vd);
    for (int t = 0; t < C; ++t)
      for (int h = 0; h < nh; ++h)
        for (int r = 0; r < nope + vd; ++r) {
          const float* wr = kv_b.data() + (size_t(h) * (nope + vd) + r) * R;
          double acc = 0;
          for (int c = 0; c < R; ++c) acc += double(wr[c]) * lat[size_t(t) * W + c];
          if (r < nope)
            K[(size_t(t) * nh + h) * qk + r] = float(acc);
          else
            V[(size_t(t) * nh + h) * vd + r - nope] = float(acc);
        }
    for (int t = 0; t < C; ++t)
      for (int h = 0; h < nh; ++h)
        std::copy(lat.begin() + size_t(t) * W + R, lat.begin() + size_t(t) * W + W,
                  K.begin() + (size_t(t) * nh + h) * qk + nope);
    const int32_t one_block = 0;
    const moe::cpu::PagedKv ckv{K.data(), V.data(), &one_block, C};
    std::vector<float> ref(size_t(C) * nh * vd);
    moe::cpu::attention(q.data(), nh * qk, ckv, pos.data(), ref.data(), nh * vd, C, nh, nh, qk, vd, scale, nullptr);

    // The GPU.
    std::vector<float> uk_t(size_t(nh) * R * nope), uv(size_t(nh) * vd * R);
    for (int h = 0; h < nh; ++h)
      for (int r = 0; r < nope + vd; ++r)
        for (int c = 0; c < R; ++c) {
          const float w = kv_b[(size_t(h) * (nope + vd) + r) * R + c];
          if (r < nope)
            uk_t[(size_t(h) * R + c) * nope + r] = w;
          else
            uv[(size_t(h) * vd + r - nope) * R + c] = w;
        }
    Dev<float> dproj(proj), dfreq(inv_freq);
    Dev<bf16> dnorm(to_bf16(norm_w)), duk(to_bf16(uk_t)), duv(to_bf16(uv));
    Dev<bf16> drows(size_t(blocks) * bt * W), dq_nope(size_t(C) * nh * nope), dq_abs(size_t(C) * nh * W);
    Dev<bf16> do_lat(size_t(C) * nh * R), dattn(size_t(C) * nh * vd);
    Dev<int32_t> dtab(table), dseq(seq), dpos(pos);
    const moe::cuda::PagedLatentPool pool{drows.p, dtab.p, blocks, bt, R, P, 0};
    moe::cuda::MlaRopeArgs ra;
    ra.proj = dproj.p;
    ra.row_stride = row_stride;
    ra.kv_a_norm = dnorm.p;
    ra.positions = dpos.p;
    ra.seq_of_token = dseq.p;
    ra.inv_freq = dfreq.p;
    ra.attention_factor = factor;
    ra.tokens = C;
    ra.n_heads = nh;
    ra.nope = nope;
    ra.q_nope = dq_nope.p;
    ra.q_abs = dq_abs.p;
    REQUIRE_OK(moe::cuda::mla_rope_store(ra, pool, nullptr));
    moe::cuda::HeadGemvArgs uka{duk.p, nh, R, nope, dq_nope.p, int64_t(nh) * nope, nope, dq_abs.p, int64_t(nh) * W, W, C};
    REQUIRE_OK(moe::cuda::head_gemv(uka, nullptr));
    moe::cuda::MlaAttentionArgs aa{dq_abs.p, dseq.p, dpos.p, C, nh, scale, do_lat.p};
    REQUIRE_OK(moe::cuda::mla_attention(aa, pool, nullptr));
    moe::cuda::HeadGemvArgs uva{duv.p, nh, vd, R, do_lat.p, int64_t(nh) * R, R, dattn.p, int64_t(nh) * vd, vd, C};
    REQUIRE_OK(moe::cuda::head_gemv(uva, nullptr));

    // The stored rows, at their scattered slots.
    const auto rows = as_float(drows.get());
    std::vector<float> stored(size_t(C) * W);
    for (int t = 0; t < C; ++t)
      std::copy_n(rows.begin() + (size_t(table[size_t(t / bt)]) * bt + t % bt) * W, W, stored.begin() + size_t(t) * W);
    const double row_err = rel_err(stored, lat);
    const std::vector<float> got = as_float(dattn.get());
    const double out_err = rel_err(got, ref);
    // Token by token too: late tokens' outputs are small beside early ones'.
    double worst = 0;
    for (int t = 0; t < C; ++t) {
      const size_t o = size_t(t) * nh * vd, e = o + size_t(nh) * vd;
      worst = std::max(worst, rel_err(std::vector<float>(got.begin() + o, got.begin() + e),
                                      std::vector<float>(ref.begin() + o, ref.begin() + e)));
    }
    CHECK(worst < 2e-2);
    std::printf("cuda latent attention, rank %d rope %d heads %d context %d: rows rel err %.2e, output %.2e (worst "
                "token %.2e)\n", R, P, nh, C, row_err, out_err, worst);
    CHECK(row_err < 4e-3);
    CHECK(out_err < 1e-2);

    // Decode's form: the last few tokens alone, their keys split over 2 to
    // 16 blocks (runs of whole tiles; at short contexts most splits are
    // empty) and merged, against the same reference rows.
    const int q0 = std::max(0, C - 3), nq = C - q0;
    const std::vector<float> ref_last(ref.begin() + size_t(q0) * nh * vd, ref.end());
    for (const int splits : {1, 2, 5, 16, moe::cuda::mla_splits(nq, nh)}) {
      Dev<float> dpart(std::max<size_t>(1, moe::cuda::mla_partials_floats(nq, nh, splits, R)));
      Dev<bf16> dlat_last(size_t(nq) * nh * R), dattn_last(size_t(nq) * nh * vd);
      moe::cuda::MlaAttentionArgs da{dq_abs.p + size_t(q0) * nh * W, dseq.p + q0, dpos.p + q0, nq, nh, scale,
                                     dlat_last.p, splits, dpart.p};
      REQUIRE_OK(moe::cuda::mla_attention(da, pool, nullptr));
      moe::cuda::HeadGemvArgs dv{duv.p, nh, vd, R, dlat_last.p, int64_t(nh) * R, R, dattn_last.p, int64_t(nh) * vd,
                                 vd, nq};
      REQUIRE_OK(moe::cuda::head_gemv(dv, nullptr));
      const double split_err = rel_err(as_float(dattn_last.get()), ref_last);
      INFO("splits " << splits);
      CHECK(split_err < 1e-2);
    }
  }
}

TEST_CASE("cuda latent attention refuses shapes it is not compiled for", "[cuda][mla]") {
  SKIP_WITHOUT_GPU();
  CHECK(moe::cuda::mla_shape_supported(512, 64));
  CHECK_FALSE(moe::cuda::mla_shape_supported(256, 64));
  Dev<bf16> q(64), out(64), rows(64);
  Dev<int32_t> i(4);
  const moe::cuda::PagedLatentPool pool{rows.p, i.p, 1, 16, 48, 8, 0};
  moe::cuda::MlaAttentionArgs aa{q.p, i.p, i.p, 1, 1, 1.f, out.p};
  const auto s = moe::cuda::mla_attention(aa, pool, nullptr);
  REQUIRE_FALSE(s.ok());
  CHECK(s.error().find("(48, 8)") != std::string::npos);
}
