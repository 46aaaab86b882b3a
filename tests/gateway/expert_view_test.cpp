// The /experts page's data (gateway/observe/expert_view.h) from hellos,
// step usage and stats replies, and the Basic credential the page's
// browser login sends (gateway/api_keys.h).
#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include "gateway/api_keys.h"
#include "gateway/observe/expert_view.h"
#include "gateway/predict/expert_set.h"

using namespace moe;
using namespace moe::gw;
using nlohmann::json;

namespace {

protocol::ExpertLayout layout() {
  protocol::ExpertLayout l;
  l.n_experts = 4;
  l.n_moe_layers = 2;
  l.moe_layers = {1, 3};  // a dense layer 0 and 2: rows are MoE layers
  return l;
}

protocol::StatsReply stats(std::vector<protocol::ExpertRef> resident, uint64_t hits, uint64_t misses,
                           uint64_t tokens, uint64_t bytes, uint64_t uptime_ms) {
  protocol::StatsReply r;
  r.resident = std::move(resident);
  r.islands_used = uint32_t(r.resident.size());
  r.islands_total = 3;
  r.expert_hits = hits;
  r.expert_misses = misses;
  r.tokens = tokens;
  r.bytes_copied = bytes;
  r.uptime_ms = uptime_ms;
  return r;
}

}  // namespace

TEST_CASE("expert view: resident by MoE row, heat, misses against the resident set, predictions, series",
          "[experts_page]") {
  ExpertView v;
  CHECK_FALSE(v.watched(1000));
  v.watch(1000);
  CHECK(v.watched(1000 + ExpertView::kWatchMs));
  CHECK_FALSE(v.watched(1001 + ExpertView::kWatchMs));
  v.set_worker(0, "w0", layout());
  // Before any resident set is known nothing counts as missed.
  const std::vector<uint16_t> use = {3, 0, 0, 0, 0, 0, 2, 0};  // layer 1 expert 0, layer 3 expert 2
  v.on_usage(0, use);
  v.on_stats(0, stats({{1, 0}, {3, 1}}, 10, 0, 100, 0, 1000), 1000);
  json j = json::parse(v.json());
  REQUIRE(j["workers"].size() == 1);
  json w = j["workers"][0];
  CHECK(w["name"] == "w0");
  CHECK(w["moe_layers"] == json::array({1, 3}));
  CHECK(w["resident"] == "10000100");        // model layer 3 is MoE row 1
  CHECK(w["missed"] == json::array({0, 0, 0, 0, 0, 0, 0, 0}));
  CHECK(w["hot"][0].get<double>() == Approx(1.5));  // half of 3 tokens in a second
  CHECK(w["hot"][6].get<double>() == Approx(1.0));
  CHECK(w["series"].empty());  // the first stats only set the counters' base

  // A second of use: layer 3 expert 2 is not resident (missed), layer 1
  // expert 0 is; one prediction; the counters advance.
  v.on_usage(0, use);
  v.on_usage(0, use);
  ExpertSet pred(8);
  pred.add(5);
  v.on_prediction(0, pred);
  v.on_stats(0, stats({{1, 0}, {3, 1}}, 40, 10, 300, 5000, 2000), 2000);
  w = json::parse(v.json())["workers"][0];
  CHECK(w["missed"] == json::array({0, 0, 0, 0, 0, 0, 2, 0}));
  CHECK(w["predicted"] == "00000100");
  CHECK(w["hot"][0].get<double>() == Approx(0.5 * 1.5 + 0.5 * 6).epsilon(0.02));
  REQUIRE(w["series"].size() == 1);
  CHECK(w["series"][0]["hit_rate"].get<double>() == Approx(0.75));  // 30 hits, 10 misses
  CHECK(w["series"][0]["bytes_per_token"].get<double>() == Approx(25));  // 5000 bytes over 200 tokens
  CHECK(w["series"][0]["tokens_per_s"].get<double>() == Approx(200));

  // A second without use: nothing missed or predicted any more; heat decays.
  v.on_stats(0, stats({{1, 0}}, 40, 10, 300, 5000, 3000), 3000);
  w = json::parse(v.json())["workers"][0];
  CHECK(w["missed"] == json::array({0, 0, 0, 0, 0, 0, 0, 0}));
  CHECK(w["predicted"] == "00000000");
  CHECK(w["resident"] == "10000000");
  CHECK(w["series"][1]["hit_rate"].is_null());  // no expert asked for
  // A stats reply without the resident set (nobody watched) leaves misses uncounted.
  v.on_stats(0, stats({}, 40, 10, 300, 5000, 4000), 4000);
  v.on_stats(0, [] {
    auto r = stats({}, 40, 10, 300, 5000, 4500);
    r.islands_used = 1;  // not asked: the set is absent, not empty
    return r;
  }(), 4500);
  v.on_usage(0, use);
  v.on_stats(0, stats({{1, 0}}, 40, 10, 300, 5000, 5000), 5000);
  w = json::parse(v.json())["workers"][0];
  CHECK(w["missed"] == json::array({0, 0, 0, 0, 0, 0, 0, 0}));
  // Usage longer than the map and unknown workers are ignored.
  v.on_usage(0, std::vector<uint16_t>(100, 1));
  v.on_usage(7, use);
  v.drop_worker(0);
  CHECK(json::parse(v.json())["workers"].empty());
}

TEST_CASE("basic_auth_password: the password of a Basic credential, or nothing", "[experts_page]") {
  CHECK(basic_auth_password("YW55b25lOnNrLWtleQ==") == std::optional<std::string>("sk-key"));  // anyone:sk-key
  CHECK(basic_auth_password(" OnNrLWtleQ== ") == std::optional<std::string>("sk-key"));       // :sk-key
  CHECK(basic_auth_password("dTpwOnE=") == std::optional<std::string>("p:q"));  // u:p:q: the first ':' splits
  CHECK_FALSE(basic_auth_password("bm9jb2xvbg=="));  // "nocolon"
  CHECK_FALSE(basic_auth_password("YW55b25lOnNrLWtleQ"));  // not a multiple of 4
  CHECK_FALSE(basic_auth_password("YW55=25lOnNrLWtleQ=="));  // '=' inside
  CHECK_FALSE(basic_auth_password("YW55b25lOnNr*WtleQ=="));
  CHECK_FALSE(basic_auth_password(""));
}
