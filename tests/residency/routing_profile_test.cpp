// Routing profiles: the file round-trips, bad files are refused naming what
// is wrong, the warm order is the most used first, and the policies' prior.
#include "residency/routing_profile.h"

#include <unistd.h>

#include <catch2/catch.hpp>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "residency/eviction_policy.h"

using namespace moe;

namespace {

RoutingProfile sample() {
  RoutingProfile p = RoutingProfile::shaped({1, 2, 4}, 4, 2);  // layers 0 and 3 dense
  p.model = "m";
  p.architecture = "qwen2_moe";
  p.source = "test \"quoted\"";
  const uint64_t c[] = {5, 0, 3, 2,  /**/ 1, 1, 1, 7,  /**/ 0, 10, 0, 0};
  p.counts.assign(std::begin(c), std::end(c));
  p.tokens = 5;
  return p;
}

std::string refusal(const std::string& text) {
  auto r = parse_routing_profile(text);
  REQUIRE_FALSE(r.ok());
  return r.error();
}

}  // namespace

TEST_CASE("routing profile: format and parse round-trip") {
  const RoutingProfile p = sample();
  const std::string text = format_routing_profile(p);
  auto q = parse_routing_profile(text);
  REQUIRE(q.ok());
  CHECK(q->model == "m");
  CHECK(q->architecture == "qwen2_moe");
  CHECK(q->source == p.source);
  CHECK(q->n_experts == 4);
  CHECK(q->top_k == 2);
  CHECK(q->tokens == 5);
  CHECK(q->model_layers == std::vector<int>{1, 2, 4});
  CHECK(q->counts == p.counts);
  CHECK(format_routing_profile(*q) == text);
}

TEST_CASE("routing profile: warm order, coverage, rates") {
  const RoutingProfile p = sample();
  const std::vector<ExpertKey> order = p.warm_order();
  // 10 (2/1), 7 (1/3), 5 (0/0), 3 (0/2), 2 (0/3), then the 1s by layer and expert; no zeros.
  REQUIRE(order.size() == 8);
  CHECK(order[0] == ExpertKey{2, 1});
  CHECK(order[1] == ExpertKey{1, 3});
  CHECK(order[2] == ExpertKey{0, 0});
  CHECK(order[3] == ExpertKey{0, 2});
  CHECK(order[4] == ExpertKey{0, 3});
  CHECK(order[5] == ExpertKey{1, 0});
  CHECK(order[6] == ExpertKey{1, 1});
  CHECK(order[7] == ExpertKey{1, 2});
  CHECK(p.coverage(0) == 0.0);
  CHECK(p.coverage(2) == Approx(17.0 / 30.0));
  CHECK(p.coverage(100) == 1.0);
  const std::vector<double> r = p.rates(2);
  CHECK(r == std::vector<double>{0.0, 1.0, 0.0, 0.0});  // 10 uses over 5 tokens is capped at 1
  CHECK(p.rates(0)[0] == Approx(1.0));
  CHECK(p.rates(0)[2] == Approx(0.6));
  RoutingProfile empty = RoutingProfile::shaped({0}, 3, 1);
  CHECK(empty.warm_order().empty());
  CHECK(empty.coverage(3) == 1.0);
  CHECK(empty.rates(0) == std::vector<double>{0.0, 0.0, 0.0});
}

TEST_CASE("routing profile: add accumulates usage and tokens") {
  RoutingProfile p = RoutingProfile::shaped({0, 1}, 2, 1);
  const uint64_t a[] = {1, 0, 0, 1};
  p.add(a, 1);
  p.add(a, 1);
  CHECK(p.counts == std::vector<uint64_t>{2, 0, 0, 2});
  CHECK(p.tokens == 2);
  const uint64_t longer[] = {1, 1, 1, 1, 9, 9};  // past the shape: ignored
  p.add(longer, 1);
  CHECK(p.counts == std::vector<uint64_t>{3, 1, 1, 3});
}

TEST_CASE("routing profile: a model of another shape is named") {
  const RoutingProfile p = sample();
  CHECK(p.mismatch({1, 2, 4}, 4).empty());
  CHECK(p.mismatch({1, 2, 4}, 8) == "the profile has 4 experts a layer, the model 8");
  CHECK(p.mismatch({1, 2}, 4) == "the profile has 3 MoE layers, the model 2");
  CHECK(p.mismatch({0, 1, 2}, 4) == "the profile has 3 MoE layers, the model 3 at other layer indices");
}

TEST_CASE("routing profile: bad files are refused, saying why") {
  const std::string good = format_routing_profile(sample());
  auto edit = [&](const std::string& from, const std::string& to) {
    std::string t = good;
    const size_t at = t.find(from);
    REQUIRE(at != std::string::npos);
    return t.replace(at, from.size(), to);
  };
  CHECK(refusal(good.substr(0, good.size() / 2)).rfind("not JSON", 0) == 0);
  CHECK(refusal("[1, 2]") == "not a JSON object");
  CHECK(refusal(edit("\"moe-routing-profile\"", "\"other\"")) == "'format' is not \"moe-routing-profile\"");
  CHECK(refusal(edit("\"version\":1", "\"version\":2")) == "'version' is not 1");
  CHECK(refusal(edit("\"n_experts\":4", "\"n_experts\":0")) == "'n_experts' is 0");
  CHECK(refusal(edit("\"n_experts\":4", "\"n_experts\":5000")) == "'n_experts' is 5000, past 4096");
  CHECK(refusal(edit("\"n_experts\":4", "\"n_experts\":3")) == "layers[0] has 4 counts, not n_experts = 3");
  CHECK(refusal(edit("\"top_k\":2", "\"top_k\":9")) == "'top_k' is 9, past 4");
  CHECK(refusal(edit("[5,0,3,2]", "[5,-1,3,2]")) == "layers[0].counts[1] is not a non-negative integer");
  CHECK(refusal(edit("[5,0,3,2]", "[5,0.5,3,2]")) == "layers[0].counts[1] is not a non-negative integer");
  CHECK(refusal(edit("[5,0,3,2]", "[5,\"0\",3,2]")) == "layers[0].counts[1] is not a non-negative integer");
  CHECK(refusal(edit("{\"layer\": 2,", "{\"layer\": 1,")) == "layers[1].layer 1 does not follow layer 1");
  CHECK(refusal(edit("{\"layer\": 2, \"counts\"", "{\"layer\": 2, \"c\"")) ==
        "layers[1] is not {\"layer\", \"counts\": [...]}");
  CHECK(refusal(edit("\"model\":\"m\"", "\"model\":7")) == "'model' is not a string");
  CHECK(refusal(edit("\"layers\": [", "\"layers_\": [")) == "no 'layers' array");
}

TEST_CASE("routing profile: written whole by rename, read back; an absent file is named") {
  const std::string dir = std::filesystem::temp_directory_path() / ("moe-profile-" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  const std::string path = dir + "/p.json";
  REQUIRE(write_routing_profile(path, sample()).ok());
  REQUIRE(write_routing_profile(path, sample()).ok());  // replaces
  auto back = read_routing_profile(path);
  REQUIRE(back.ok());
  CHECK(back->counts == sample().counts);
  size_t files = 0;
  for (const auto& e : std::filesystem::directory_iterator(dir)) files += e.is_regular_file();
  CHECK(files == 1);  // no temporary left beside it
  auto none = read_routing_profile(dir + "/absent.json");
  REQUIRE_FALSE(none.ok());
  CHECK(none.error() == "cannot open routing profile " + dir + "/absent.json");
  CHECK_FALSE(write_routing_profile(dir + "/no/such/dir/p.json", sample()).ok());
  std::filesystem::remove_all(dir);
}

TEST_CASE("eviction policies: a seeded layer prefers the profile's hot experts, a used one keeps what it learned") {
  for (const char* name : {"ours", "lfu"}) {
    std::unique_ptr<EvictionPolicy> p;
    if (std::string(name) == "ours") p = std::make_unique<OursPolicy>();
    else p = std::make_unique<LfuDecayPolicy>();
    p->attach(2, 4);
    const double rates[] = {0.1, 0.9, 0.5, 0.0};
    p->seed(0, rates);
    INFO(name);
    CHECK(p->keep_score({0, 1}, 0) > p->keep_score({0, 2}, 0));
    CHECK(p->keep_score({0, 2}, 0) > p->keep_score({0, 0}, 0));
    CHECK(p->keep_score({0, 0}, 0) >= p->keep_score({0, 3}, 0));
    // Layer 1 was used before the seed: its estimates stay its own.
    p->on_access({1, 3}, 1);
    const double before = p->keep_score({1, 0}, 2), hot = p->keep_score({1, 3}, 2);
    p->seed(1, rates);
    CHECK(p->keep_score({1, 0}, 2) == before);
    CHECK(p->keep_score({1, 3}, 2) == hot);
  }
  LruPolicy lru;
  lru.attach(1, 2);
  const double rates[] = {1.0, 0.0};
  lru.seed(0, rates);
  CHECK(lru.keep_score({0, 0}, 0) == lru.keep_score({0, 1}, 0));
}
