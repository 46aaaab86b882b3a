// The KV cache in one byte a value (docs/kv-cache.md): what it costs on the
// demo model's held-out text (perplexity) and, at the longest context each
// fixture takes, how often the logits' best tokens stay those of the f32
// cache, on all six architectures (MLA's rows included).

#include <catch2/catch.hpp>
#include <algorithm>
#include <random>
#include <set>

#include "engine/perplexity.h"
#include "tests/engine/reference_data.h"

using namespace moe;
using namespace moe::test;

namespace {

std::unique_ptr<CpuEngine> engine_with(const std::string& dir, KvDtype d) {
  EngineOptions o;
  o.kv_dtype = d;
  return make_engine(dir, o);
}

struct Agreement {
  double top1 = 0;      // share of positions whose best token is the same
  double top5 = 0;      // mean overlap of the 5 best, / 5
};

Agreement agree(const std::vector<float>& a, const std::vector<float>& b, int vocab) {
  const size_t rows = a.size() / size_t(vocab);
  Agreement g;
  std::vector<int> ia(static_cast<size_t>(vocab)), ib(static_cast<size_t>(vocab));
  for (size_t r = 0; r < rows; ++r) {
    const float* x = a.data() + r * size_t(vocab);
    const float* y = b.data() + r * size_t(vocab);
    for (int i = 0; i < vocab; ++i) ia[size_t(i)] = ib[size_t(i)] = i;
    std::partial_sort(ia.begin(), ia.begin() + 5, ia.end(), [&](int p, int q) { return x[p] > x[q]; });
    std::partial_sort(ib.begin(), ib.begin() + 5, ib.end(), [&](int p, int q) { return y[p] > y[q]; });
    g.top1 += ia[0] == ib[0];
    std::set<int> s(ia.begin(), ia.begin() + 5);
    int common = 0;
    for (int k = 0; k < 5; ++k) common += int(s.count(ib[size_t(k)]));
    g.top5 += common / 5.0;
  }
  g.top1 /= double(rows);
  g.top5 /= double(rows);
  return g;
}

}  // namespace

TEST_CASE("KV in one byte: the demo model's perplexity moves by less than 0.5 %", "[engine][demo][kv]") {
  const auto ids = demo_eval_ids(4097);
  auto base = engine_with(demo_dir(), KvDtype::bf16);
  auto want = mean_nll(*base, ids, 512);
  REQUIRE(want.ok());
  for (KvDtype d : {KvDtype::int8, KvDtype::fp8}) {
    auto e = engine_with(demo_dir(), d);
    auto got = mean_nll(*e, ids, 512);
    REQUIRE(got.ok());
    const double rel = std::exp(got->nll - want->nll) - 1.0;
    INFO((d == KvDtype::int8 ? "int8" : "fp8") << ": perplexity " << std::exp(got->nll) << " against "
                                               << std::exp(want->nll) << " (" << 100 * rel << " %)");
    CHECK(std::fabs(rel) < 0.005);
    CHECK(got->nll != want->nll);  // the codes are really in use
  }
}

TEST_CASE("KV in one byte: the demo model's best tokens over a 2,048-token context", "[engine][demo][kv]") {
  const auto ids = demo_eval_ids(2048);
  auto base = engine_with(demo_dir(), KvDtype::bf16);
  auto want = base->forward_logits(ids);
  REQUIRE(want.ok());
  for (KvDtype d : {KvDtype::int8, KvDtype::fp8}) {
    auto e = engine_with(demo_dir(), d);
    auto got = e->forward_logits(ids);
    REQUIRE(got.ok());
    const Agreement g = agree(*want, *got, base->desc().vocab_size);
    INFO((d == KvDtype::int8 ? "int8" : "fp8") << ": top-1 " << g.top1 << ", top-5 " << g.top5);
    // Measured: int8 0.990 and 0.989, fp8 0.968 and 0.964.
    CHECK(g.top1 >= (d == KvDtype::int8 ? 0.985 : 0.955));
    CHECK(g.top5 >= (d == KvDtype::int8 ? 0.98 : 0.955));
  }
}

TEST_CASE("KV in one byte: the fixtures' best tokens at their longest context", "[engine][fixtures][kv]") {
  for (const char* arch : {"qwen2_moe", "qwen3_moe", "mixtral", "olmoe", "qwen2_dense", "deepseek_v2"}) {
    auto base = engine_with(fixture_dir(arch), KvDtype::bf16);
    const int vocab = base->desc().vocab_size;
    std::mt19937 rng(7);
    std::vector<int32_t> ids(511);  // max_position 512
    for (auto& t : ids) t = int32_t(rng() % uint32_t(vocab));
    auto want = base->forward_logits(ids);
    REQUIRE(want.ok());
    for (KvDtype d : {KvDtype::int8, KvDtype::fp8}) {
      auto e = engine_with(fixture_dir(arch), d);
      auto got = e->forward_logits(ids);
      REQUIRE(got.ok());
      const Agreement g = agree(*want, *got, vocab);
      INFO(arch << " " << (d == KvDtype::int8 ? "int8" : "fp8") << ": top-1 " << g.top1 << ", top-5 " << g.top5
               );
      // Random-weight fixtures have flat logits, many near ties: measured
      // int8 top-1 0.94-0.98, fp8 0.89-0.93 (a broken row would agree at
      // about 1 / vocab).
      CHECK(g.top1 >= (d == KvDtype::int8 ? 0.92 : 0.85));
      CHECK(g.top5 >= (d == KvDtype::int8 ? 0.93 : 0.90));
    }
  }
}
