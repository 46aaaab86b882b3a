// The demo model (a really trained Qwen3-MoE): its perplexity on held-out text
// equals what transformers computes, and greedy samples match.

#include <catch2/catch.hpp>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "engine/perplexity.h"
#include "model/packed_model.h"
#include "tests/engine/reference_data.h"

using namespace moe;
using namespace moe::test;

TEST_CASE("demo model: perplexity of the held-out text matches transformers", "[engine][demo]") {
  auto e = make_engine(demo_dir());
  auto ref = Checkpoint::open_file(demo_dir() + "/reference.safetensors");
  REQUIRE(ref.ok());
  const auto ids = ints(*ref->find("eval.ids"));
  REQUIRE(ids.size() == 8193);
  double want;
  std::memcpy(&want, ref->find("eval.nll_fp32")->data, 8);
  auto r = mean_nll(*e, ids, 512);
  REQUIRE(r.ok());
  CHECK(r->tokens == 8192);
  INFO("nll " << r->nll << " reference " << want);
  CHECK(std::abs(r->nll - want) <= 0.002 * want);
}

TEST_CASE("demo model: greedy samples match transformers", "[engine][demo]") {
  auto e = make_engine(demo_dir());
  std::ifstream f(demo_dir() + "/reference.json");
  const auto j = nlohmann::json::parse(f);
  int n = 0;
  for (const auto& s : j["samples"]) {
    SeqInput in;
    in.seq_id = uint64_t(++n);
    in.tokens = s["prompt_ids"].get<std::vector<int32_t>>();
    in.sampling.temperature = 0;
    const auto want = s["greedy_ids"].get<std::vector<int32_t>>();
    std::vector<int32_t> got;
    for (size_t k = 0; k < want.size(); ++k) {
      auto out = e->step(std::span<const SeqInput>(&in, 1));
      REQUIRE(out.ok());
      got.push_back((*out)[0].token);
      in.start_pos += int32_t(in.tokens.size());
      in.tokens = {(*out)[0].token};
    }
    CHECK(got == want);
  }
  CHECK(n == 4);
}

TEST_CASE("demo model: INT4 experts raise perplexity by at most 3%", "[engine][demo][int4]") {
  const std::string packed = std::filesystem::temp_directory_path() / "moe_engine_test_demo_q4.moe";
  PackOptions po;
  po.group_size = 64;
  po.threads = 2;
  REQUIRE(write_packed_model(demo_dir(), packed, po).ok());
  auto files = ModelFiles::open(packed);
  REQUIRE(files.ok());
  REQUIRE(files.value()->experts_q4());
  EngineOptions opts;
  opts.threads = 2;
  auto e = CpuEngine::create(files.value(), opts);
  REQUIRE(e.ok());
  REQUIRE(e.value()->experts_q4());
  auto ref = Checkpoint::open_file(demo_dir() + "/reference.safetensors");
  REQUIRE(ref.ok());
  const auto ids = ints(*ref->find("eval.ids"));
  double want;
  std::memcpy(&want, ref->find("eval.nll_fp32")->data, 8);
  auto r = mean_nll(*e.value(), ids, 512);
  std::filesystem::remove(packed);
  REQUIRE(r.ok());
  const double ppl = std::exp(r->nll), ppl_ref = std::exp(want);
  INFO("int4 g64 ppl " << ppl << " reference " << ppl_ref);
  CHECK(std::abs(r->nll - want) > 1e-5);  // the INT4 experts really ran
  CHECK(ppl <= ppl_ref * 1.03);
}
