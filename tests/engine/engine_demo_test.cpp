// The demo model (a really trained Qwen3-MoE): its perplexity on held-out text
// equals what transformers computes, and greedy samples match.

#include <catch2/catch.hpp>

#include <nlohmann/json.hpp>
#include <fstream>

#include "engine/perplexity.h"
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
