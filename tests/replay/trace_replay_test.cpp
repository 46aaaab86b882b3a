// Routing traces: reading both formats, the predictor, and the policies'
// ranking on the demo model's real routing (eval.routing_topk).
#include "replay/trace_replay.h"

#include <unistd.h>

#include <catch2/catch.hpp>
#include <cstdio>
#include <fstream>
#include <map>

using namespace moe;

namespace {

const std::string kDemoReference =
    std::string(MOE_TEST_DATA) + "/../../models/demo-moe/reference.safetensors";

ResidencyStats replay(const RoutingTrace& t, const std::string& policy, int64_t slots,
                      bool predict = false) {
  auto p = make_policy(policy, t);
  REQUIRE(p.ok());
  ReplayOptions o;
  o.slots = slots;
  o.expert_bytes = 100;
  o.predict = predict;
  auto r = replay_trace(t, std::move(p.value()), o);
  REQUIRE(r.ok());
  return r->stats;
}

}  // namespace

TEST_CASE("routing trace: JSON lines parse, bounds come from the data") {
  auto t = parse_routing_jsonl(
      "{\"token\": 0, \"layer\": 0, \"experts\": [3, 1]}\n"
      "\n"
      "{\"token\": 0, \"layer\": 1, \"experts\": [7, 2]}\r\n"
      "{\"token\": 1, \"layer\": 0, \"experts\": [0, 5]}\n");
  REQUIRE(t.ok());
  CHECK(t->steps.size() == 3);
  CHECK(t->n_layers == 2);
  CHECK(t->n_experts == 8);
  CHECK(t->top_k == 2);
  CHECK(t->steps[1].experts == std::vector<int>{7, 2});
  CHECK(t->steps[2].token == 1);
  const auto seq = t->access_sequence();
  REQUIRE(seq.size() == 6);
  CHECK(seq[2] == ExpertKey{1, 7});
}

TEST_CASE("routing trace: a bad line is an error naming it") {
  auto a = parse_routing_jsonl("{\"layer\": 0, \"experts\": [1]}\n{\"layer\": 0}\n");
  REQUIRE_FALSE(a.ok());
  CHECK(a.error().find("line 2") != std::string::npos);
  CHECK_FALSE(parse_routing_jsonl("{\"layer\": 0, \"experts\": [\"x\"]}").ok());
  CHECK_FALSE(parse_routing_jsonl("{\"layer\": -1, \"experts\": [1]}").ok());
  CHECK_FALSE(parse_routing_jsonl("not json").ok());
  CHECK_FALSE(parse_routing_jsonl("").ok());
  CHECK_FALSE(read_routing_trace("/nonexistent/trace.jsonl").ok());
}

TEST_CASE("routing trace: [layers, tokens, k] is replayed token by token, layer by layer") {
  // layer l, token t, slot j holds 100*l + 10*t + j
  std::vector<int> ids;
  for (int l = 0; l < 2; ++l)
    for (int t = 0; t < 3; ++t)
      for (int j = 0; j < 2; ++j) ids.push_back(100 * l + 10 * t + j);
  const RoutingTrace tr = trace_from_topk(ids, 2, 3, 2);
  REQUIRE(tr.steps.size() == 6);
  CHECK(tr.steps[0].layer == 0);
  CHECK(tr.steps[1].layer == 1);
  CHECK(tr.steps[1].token == 0);
  CHECK(tr.steps[1].experts == std::vector<int>{100, 101});
  CHECK(tr.steps[4].experts == std::vector<int>{20, 21});
}

TEST_CASE("routing trace: a JSON-lines file of the demo routing reads back as the tensor does") {
  auto full = read_routing_trace(kDemoReference);
  REQUIRE(full.ok());
  const std::string path = "/tmp/moe_residency_test_" + std::to_string(::getpid()) + ".jsonl";
  {
    std::ofstream f(path);
    for (size_t i = 0; i < 600; ++i) {
      const RoutingStep& s = full->steps[i];
      f << "{\"token\": " << s.token << ", \"layer\": " << s.layer << ", \"experts\": [";
      for (size_t j = 0; j < s.experts.size(); ++j) f << (j ? ", " : "") << s.experts[j];
      f << "]}\n";
    }
  }
  auto part = read_routing_trace(path);
  std::remove(path.c_str());
  REQUIRE(part.ok());
  REQUIRE(part->steps.size() == 600);
  CHECK(part->n_layers == 6);
  CHECK(part->top_k == 4);
  for (size_t i = 0; i < 600; ++i) {
    CHECK(part->steps[i].layer == full->steps[i].layer);
    CHECK(part->steps[i].token == full->steps[i].token);
    CHECK(part->steps[i].experts == full->steps[i].experts);
  }
  // Known values of the demo routing: token 0, layers 0 and 1.
  CHECK(full->steps[0].experts == std::vector<int>{1, 21, 2, 28});
  CHECK(full->steps[1].experts == std::vector<int>{17, 10, 8, 18});
  CHECK_FALSE(
      read_routing_trace(kDemoReference, "eval.ids").ok());  // [8193] is not [layers, tokens, k]
}

TEST_CASE("predictor: learns a fixed layer-to-layer mapping online") {
  ExpertPredictor p(3, 8);
  // Layer l expert e is always followed by expert (e + 3) % 8 at layer l+1.
  int e = 0;
  for (int tok = 0; tok < 50; ++tok) {
    int cur = e;
    for (int l = 0; l < 3; ++l) {
      const std::vector<int> ex{cur};
      p.observe(l, ex);
      cur = (cur + 3) % 8;
    }
    e = (e + 5) % 8;
  }
  const std::vector<int> at{6};
  const auto g = p.predict_next(1, at);
  REQUIRE_FALSE(g.empty());
  CHECK(g[0] == 1);
  CHECK(p.probability(1, at, 1) > 0.8);
  CHECK(p.probability(1, at, 2) < 0.05);
}

TEST_CASE("predictor: hinting one layer ahead turns predictable misses into prefetches") {
  RoutingTrace t;
  t.n_layers = 4;
  t.n_experts = 16;
  t.top_k = 2;
  uint32_t x = 7;
  for (int tok = 0; tok < 500; ++tok) {
    x = x * 1664525u + 1013904223u;
    int a = int((x >> 10) % 16);
    for (int l = 0; l < 4; ++l) {
      t.steps.push_back({tok, l, {a, (a + 8) % 16}});
      a = (a * 5 + 1) % 16;  // the next layer's experts follow from this one's
    }
  }
  const ResidencyStats plain = replay(t, "ours", 16);
  const ResidencyStats pred = replay(t, "ours", 16, /*predict=*/true);
  CHECK(pred.prefetches > 0);
  CHECK(pred.prefetch_used > pred.prefetches / 2);
  CHECK(pred.hit_rate() > plain.hit_rate() + 0.2);
}

TEST_CASE("demo trace: ours beats lru at 25, 50 and 75 % resident; belady bounds everyone") {
  auto tr = read_routing_trace(kDemoReference);
  REQUIRE(tr.ok());
  const RoutingTrace& t = *tr;
  REQUIRE(t.n_layers == 6);
  REQUIRE(t.n_experts == 32);
  REQUIRE(t.top_k == 4);
  REQUIRE(t.steps.size() == size_t(6 * 8192));
  for (int64_t slots : {48, 96, 144}) {
    std::map<std::string, double> hr;
    for (const char* p : {"lru", "lfu", "ours", "belady"}) hr[p] = replay(t, p, slots).hit_rate();
    const double pred = replay(t, "ours", slots, true).hit_rate();
    INFO("slots " << slots << " lru " << hr["lru"] << " lfu " << hr["lfu"] << " ours " << hr["ours"]
                  << " pred " << pred << " belady " << hr["belady"]);
    CHECK(hr["ours"] > hr["lru"]);
    CHECK(hr["ours"] >= hr["lfu"]);
    CHECK(pred > hr["ours"]);
    for (const auto& [name, v] : hr) CHECK(hr["belady"] >= v);
  }
}

TEST_CASE("warm profile: on the demo's real routing, a profile of the first half starts the second half with fewer misses") {
  auto all = read_routing_trace(kDemoReference);
  REQUIRE(all.ok());
  // The profile counts tokens 0..4095; the replay is the next 100 tokens,
  // as the first requests after a start would meet them.
  const RoutingTrace first = trace_slice(*all, 0, 4096);
  RoutingProfile prof = RoutingProfile::shaped({0, 1, 2, 3, 4, 5}, 32, 4);
  for (const RoutingStep& s : first.steps)
    for (int e : s.experts) ++prof.counts[size_t(s.layer) * 32 + size_t(e)];
  prof.tokens = 4096;
  const RoutingTrace probe = trace_slice(*all, 4096, 100);
  REQUIRE(probe.steps.size() == 600);
  for (const char* policy : {"ours", "lfu"}) {
    auto run = [&](const RoutingProfile* p, bool seed) {
      auto pol = make_policy(policy, probe);
      REQUIRE(pol.ok());
      ReplayOptions o;
      o.slots = 96;
      o.expert_bytes = 100;
      o.n_experts = 32;
      o.warm_profile = p;
      o.seed = seed;
      auto r = replay_trace(probe, std::move(pol.value()), o);
      REQUIRE(r.ok());
      return r->stats.misses;
    };
    const uint64_t cold = run(nullptr, true), warm = run(&prof, false), seeded = run(&prof, true);
    INFO(policy << ": cold " << cold << ", warmed " << warm << ", warmed and seeded " << seeded);
    // Warming alone saves at most one fill of the islands.
    CHECK(warm < cold);
    CHECK(cold - warm <= 96);
    // The prior keeps the profile's hot experts through the first misses.
    CHECK(seeded < warm);
    CHECK(double(seeded) < 0.85 * double(cold));
  }
}

TEST_CASE("warm profile: another shape is refused, the LRU policy takes no prior") {
  auto all = read_routing_trace(kDemoReference);
  REQUIRE(all.ok());
  const RoutingTrace probe = trace_slice(*all, 0, 10);
  RoutingProfile small = RoutingProfile::shaped({0, 1, 2}, 32, 4);
  auto pol = make_policy("ours", probe);
  REQUIRE(pol.ok());
  ReplayOptions o;
  o.slots = 48;
  o.warm_profile = &small;
  auto r = replay_trace(probe, std::move(pol.value()), o);
  REQUIRE_FALSE(r.ok());
  CHECK(r.error().find("do not cover the trace's 6 x 32") != std::string::npos);
  // A recency policy has no prior: warming with and without the seed is the same.
  RoutingProfile prof = RoutingProfile::shaped({0, 1, 2, 3, 4, 5}, 32, 4);
  for (const RoutingStep& s : all->steps)
    for (int e : s.experts) ++prof.counts[size_t(s.layer) * 32 + size_t(e)];
  prof.tokens = 8192;
  auto misses = [&](bool seed) {
    auto p = make_policy("lru", probe);
    REQUIRE(p.ok());
    ReplayOptions q;
    q.slots = 48;
    q.warm_profile = &prof;
    q.seed = seed;
    auto res = replay_trace(probe, std::move(p.value()), q);
    REQUIRE(res.ok());
    return res->stats.misses;
  };
  CHECK(misses(true) == misses(false));
}
