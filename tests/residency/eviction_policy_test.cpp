// Each eviction policy on small traces whose right answer is known.
#include <catch2/catch.hpp>

#include "replay/trace_replay.h"

using namespace moe;

namespace {

// One layer, one expert per step: the classic page-reference setting.
RoutingTrace single_layer(const std::vector<int>& refs, int n_experts) {
  RoutingTrace t;
  t.n_layers = 1;
  t.n_experts = n_experts;
  t.top_k = 1;
  for (size_t i = 0; i < refs.size(); ++i) t.steps.push_back({int64_t(i), 0, {refs[i]}});
  return t;
}

uint64_t misses(const RoutingTrace& t, const std::string& policy, int64_t slots) {
  auto p = make_policy(policy, t);
  REQUIRE(p.ok());
  ReplayOptions o;
  o.slots = slots;
  o.expert_bytes = 1;
  auto r = replay_trace(t, std::move(p.value()), o);
  INFO((r.ok() ? std::string() : r.error()));
  REQUIRE(r.ok());
  CHECK(r->stats.hits + r->stats.misses == t.access_sequence().size());
  CHECK(r->stats.bytes_copied == r->stats.misses);
  return r->stats.misses;
}

// The textbook reference string (20 references, 3 frames): OPT 9 faults, LRU 12.
const std::vector<int> kTextbook{7, 0, 1, 2, 0, 3, 0, 4, 2, 3, 0, 3, 2, 1, 2, 0, 1, 7, 0, 1};

}  // namespace

TEST_CASE("belady: 9 faults on the textbook reference string with 3 frames") {
  CHECK(misses(single_layer(kTextbook, 8), "belady", 3) == 9);
  CHECK(misses(single_layer(kTextbook, 8), "belady", 4) == 8);
}

TEST_CASE("lru: 12 faults on the textbook reference string with 3 frames") {
  CHECK(misses(single_layer(kTextbook, 8), "lru", 3) == 12);
  CHECK(misses(single_layer(kTextbook, 8), "lru", 4) == 8);
}

TEST_CASE("lfu keeps the frequent expert where lru drops it") {
  const auto t = single_layer({0, 0, 0, 1, 2, 0}, 4);
  CHECK(misses(t, "lru", 2) == 4);  // 2 evicts 0 (least recent), 0 misses again
  CHECK(misses(t, "lfu", 2) == 3);  // 2 evicts 1 (one use against three)
  CHECK(misses(t, "belady", 2) == 3);
}

TEST_CASE("belady is never beaten, whatever the policy, on a random trace") {
  RoutingTrace t;
  t.n_layers = 3;
  t.n_experts = 10;
  t.top_k = 2;
  uint32_t x = 99;
  for (int tok = 0; tok < 400; ++tok)
    for (int l = 0; l < 3; ++l) {
      x = x * 1664525u + 1013904223u;
      const int a = int((x >> 8) % 10), b = (a + 1 + int((x >> 20) % 9)) % 10;
      t.steps.push_back({tok, l, {a, b}});
    }
  for (int64_t slots : {2, 5, 12, 25}) {
    const uint64_t opt = misses(t, "belady", slots);
    for (const char* p : {"lru", "lfu", "ours"}) {
      INFO(p << " slots " << slots);
      CHECK(misses(t, p, slots) >= opt);
    }
  }
  CHECK(misses(t, "belady", 30) == 30);  // everything fits: compulsory misses only
}

// Two layers. Layer 1 uses expert 0 every token; layer 0 uses expert 0 every
// third token and a never-repeating cold expert on the others. With three
// islands the cold experts are a scan: LRU lets them push out layer 0's hot
// expert each cycle; the frequency-aware policies keep both hot experts.
TEST_CASE("ours and lfu resist a scan that defeats lru") {
  RoutingTrace t;
  t.n_layers = 2;
  t.n_experts = 256;
  t.top_k = 1;
  int cold = 1, n_cold = 0;
  const int T = 300;
  for (int tok = 0; tok < T; ++tok) {
    if (tok % 3 == 0) {
      t.steps.push_back({tok, 0, {0}});
    } else {
      t.steps.push_back({tok, 0, {cold++}});
      ++n_cold;
    }
    t.steps.push_back({tok, 1, {0}});
  }
  const uint64_t optimum = 2 + uint64_t(n_cold);  // compulsory misses only
  CHECK(misses(t, "belady", 3) == optimum);
  // Both may lose layer 0's hot expert once, while its popularity is unknown.
  CHECK(misses(t, "lfu", 3) <= optimum + 2);
  CHECK(misses(t, "ours", 3) <= optimum + 2);
  // lru loses it every cycle: one extra miss per 3 tokens.
  CHECK(misses(t, "lru", 3) >= optimum + T / 3 - 2);
}

TEST_CASE("ours: use probability follows the routing rate") {
  OursPolicy p;
  p.attach(2, 4);
  uint64_t now = 0;
  for (int tok = 0; tok < 2000; ++tok) {
    p.on_access({0, 1}, now++);                    // every visit
    if (tok % 4 == 0) p.on_access({0, 2}, now++);  // a quarter of visits
    p.on_access({1, 3}, now++);
  }
  CHECK(p.use_probability({0, 1}) == Approx(1.0).margin(0.01));
  CHECK(p.use_probability({0, 2}) == Approx(0.25).margin(0.1));
  CHECK(p.use_probability({0, 3}) == Approx(1e-3));  // never used: the floor
}

TEST_CASE("ours: of two equally used experts, keeps the one whose layer comes next") {
  OursPolicy p;
  p.attach(3, 4);
  uint64_t now = 0;
  for (int tok = 0; tok < 100; ++tok)
    for (int l = 0; l < 3; ++l) p.on_access({l, 1}, now++);
  // Now at layer 0 of the next token: layer 1 is next, layer 2 after it,
  // layer 0 itself only after a full round.
  p.on_access({0, 2}, now);
  const double k0 = p.keep_score({0, 1}, now), k1 = p.keep_score({1, 1}, now),
               k2 = p.keep_score({2, 1}, now);
  CHECK(k1 > k2);
  CHECK(k2 > k0);
}

TEST_CASE("make_policy knows its names") {
  const auto t = single_layer({0}, 1);
  for (const char* n : {"lru", "lfu", "ours", "belady"}) {
    auto p = make_policy(n, t);
    REQUIRE(p.ok());
    CHECK(p.value()->name() == n);
  }
  CHECK_FALSE(make_policy("fifo", t).ok());
}
