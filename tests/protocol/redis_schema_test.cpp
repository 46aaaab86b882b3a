// The Redis schema both processes share: the keys and entries are the bytes
// earlier releases wrote (spelled out here on purpose, so that a change to
// them fails a test instead of orphaning the state in a running Redis), the
// expert lists and routing summaries survive a round trip, and malformed
// text is refused with a message instead of read half-way.
#include <catch2/catch.hpp>
#include <string>
#include <vector>

#include "protocol/redis_schema.h"

using namespace moe::protocol;

TEST_CASE("keys are the ones already in Redis", "[redis]") {
  CHECK(resident_stream_key("demo-moe") == "moe:demo-moe:resident");
  CHECK(routing_stream_key("demo-moe") == "moe:demo-moe:routing");
  CHECK(events_stream_key("demo-moe") == "moe:demo-moe:events");
  CHECK(kEventsGroup == "workers");
  CHECK(session_key(kSessionOwnerOpen, "s-0123") == "moe:session:open:s-0123");
  CHECK(session_key(session_owner_of_key("ab12"), "chat") == "moe:session:kab12:chat");
  CHECK(kStreamMaxLen == 10000);
}

TEST_CASE("the model's name in the keys is the last part of its path", "[redis]") {
  CHECK(redis_model_name("models/demo-moe") == "demo-moe");
  CHECK(redis_model_name("models/demo-moe/") == "demo-moe");
  CHECK(redis_model_name("models/demo-moe//") == "demo-moe");
  CHECK(redis_model_name("/srv/qwen3.moe") == "qwen3.moe");
  CHECK(redis_model_name("demo-moe") == "demo-moe");
  CHECK(redis_model_name("/").empty());
}

TEST_CASE("entries carry their fields in the order earlier releases wrote", "[redis]") {
  CHECK(resident_entry("w.sock", kResidentSnapshot, "0:1 2:3") ==
        StreamFields{"worker", "w.sock", "kind", "snapshot", "experts", "0:1 2:3"});
  CHECK(resident_entry("w.sock", kResidentChange, "") ==
        StreamFields{"worker", "w.sock", "kind", "change", "experts", ""});
  CHECK(routing_entry("w.sock", 42, "0:3=5", 0) ==
        StreamFields{"worker", "w.sock", "seq", "42", "layers", "0:3=5"});
  CHECK(routing_entry("w.sock", 42, "0:3=5", 9223372036854775809ull) ==
        StreamFields{"worker", "w.sock", "seq", "42", "layers", "0:3=5", "bucket",
                     "9223372036854775809"});
  CHECK(warm_event("1:2") == StreamFields{"type", "warm", "experts", "1:2"});
  CHECK(session_event("0123456789abcdef", 4) ==
        StreamFields{"type", "session", "session", "0123456789abcdef", "messages", "4"});
  CHECK(stream_append_command("moe:m:events", 50, warm_event("1:2")) ==
        std::vector<std::string>{"XADD", "moe:m:events", "MAXLEN", "~", "50", "*", "type", "warm",
                                 "experts", "1:2"});
}

TEST_CASE("fields are found by name; an absent one is not an empty one", "[redis]") {
  const StreamFields f = {"worker", "w", "experts", "", "worker", "second"};
  REQUIRE(find_field(f, "worker"));
  CHECK(*find_field(f, "worker") == "w");  // the first wins
  REQUIRE(find_field(f, "experts"));
  CHECK(find_field(f, "experts")->empty());
  CHECK(find_field(f, "kind") == nullptr);
  CHECK(find_field({"worker"}, "worker") == nullptr);  // a name without its value
  CHECK(find_field({}, "worker") == nullptr);
}

TEST_CASE("expert lists survive a round trip", "[redis]") {
  const std::vector<ExpertRef> none;
  CHECK(format_expert_list(none).empty());
  REQUIRE(parse_expert_list("").ok());
  CHECK(parse_expert_list("").value().empty());

  const std::vector<ExpertRef> some = {{3, 17}, {3, 20}, {5, 1}, {0, 0}, {65535, 65535}};
  const std::string text = format_expert_list(some);
  CHECK(text == "3:17 3:20 5:1 0:0 65535:65535");
  auto back = parse_expert_list(text);
  REQUIRE(back.ok());
  CHECK(back.value() == some);

  // The largest list a message may carry, at the largest numbers.
  std::vector<ExpertRef> many(kMaxExpertsPerMessage, ExpertRef{65535, 65535});
  for (size_t i = 0; i < many.size(); ++i) many[i] = {uint16_t(i >> 8), uint16_t(i)};
  const std::string long_text = format_expert_list(many);
  CHECK(long_text.size() < kMaxExpertListBytes);
  auto long_back = parse_expert_list(long_text);
  REQUIRE(long_back.ok());
  CHECK(long_back.value() == many);
}

TEST_CASE("expert lists tolerate extra spaces and leading zeros, as before", "[redis]") {
  auto r = parse_expert_list("  3:17   03:020 ");
  REQUIRE(r.ok());
  CHECK(r.value() == std::vector<ExpertRef>{{3, 17}, {3, 20}});
  CHECK(parse_expert_list("   ").ok());
}

TEST_CASE("malformed expert lists are refused, quoting the bad pair", "[redis]") {
  for (const char* bad :
       {"banana",     "3",      "3:",    ":3",      "3:17:1",  "3;17",
        "3:17,3:18",  "-1:2",   "1:-2",  "-0:1",    "+1:2",    "1:+2",
        "0x1:2",      "1:2a",   "1.0:2", "65536:0", "0:65536", "99999999999999999999:1",
        "3:17\t3:18", "3:17\n", "1 :2",  "1: 2",    "3:17 x"}) {
    INFO(bad);
    auto r = parse_expert_list(bad);
    REQUIRE_FALSE(r.ok());
    CHECK(r.error().find("not a layer:expert pair") != std::string::npos);
  }
  // The message quotes the pair that failed, at most 40 bytes of it.
  auto r = parse_expert_list("1:2 " + std::string(100, 'z'));
  REQUIRE_FALSE(r.ok());
  CHECK(r.error().find("'" + std::string(40, 'z') + "'") != std::string::npos);
  CHECK(r.error().find(std::string(41, 'z')) == std::string::npos);
}

TEST_CASE("expert lists past the bounds are refused", "[redis]") {
  std::string over;
  for (size_t i = 0; i <= kMaxExpertsPerMessage; ++i) over += "1:1 ";
  auto r = parse_expert_list(over);
  REQUIRE_FALSE(r.ok());
  CHECK(r.error().find("more than") != std::string::npos);

  auto huge = parse_expert_list(std::string(kMaxExpertListBytes + 1, ' '));
  REQUIRE_FALSE(huge.ok());
  CHECK(huge.error().find("longer than") != std::string::npos);
}

TEST_CASE("routing summaries survive a round trip", "[redis]") {
  // 3 MoE layers of 4 experts; layer 1 served nothing.
  const std::vector<uint32_t> usage = {0, 5, 0, 2,  //
                                       0, 0, 0, 0,  //
                                       7, 0, 0, 4000000000u};
  const std::string text = format_routing_layers(usage, 4);
  CHECK(text == "0:1=5,3=2 2:0=7,3=4000000000");
  auto back = parse_routing_layers(text, 3, 4);
  REQUIRE(back.ok());
  REQUIRE(back.value().size() == usage.size());
  for (size_t i = 0; i < usage.size(); ++i) CHECK(back.value()[i] == float(usage[i]));

  CHECK(format_routing_layers(std::vector<uint32_t>(8, 0), 4).empty());
  CHECK(format_routing_layers({}, 4).empty());
  // A partial last layer, and a model whose expert count is not known yet.
  CHECK(format_routing_layers(std::vector<uint32_t>{1, 0, 0, 0, 0, 3}, 4) == "0:0=1 1:1=3");
  CHECK(format_routing_layers(std::vector<uint32_t>{2, 3}, 0) == "0:0=2 1:0=3");
}

TEST_CASE("routing summaries read as before", "[redis]") {
  auto u = parse_routing_layers("0:3=5,7=2 1:0=1", 2, 8);
  REQUIRE(u.ok());
  CHECK(u.value()[3] == 5);
  CHECK(u.value()[7] == 2);
  CHECK(u.value()[8] == 1);
  // A layer or an expert named twice adds up; empty layers and a trailing
  // comma are tolerated, as is extra space.
  auto twice = parse_routing_layers(" 0:1=2,1=3  0:1=1, 1:", 2, 2);
  REQUIRE(twice.ok());
  CHECK(twice.value() == std::vector<float>{0, 6, 0, 0});
  REQUIRE(parse_routing_layers("", 2, 8).ok());
  CHECK(parse_routing_layers("", 2, 8).value() == std::vector<float>(16, 0.0f));
}

TEST_CASE("malformed routing summaries are refused, quoting the bad part", "[redis]") {
  for (const char* bad : {"2:0=1", "x:1=1", "0", "-1:0=1", "-0:0=1", "+0:0=1", "99999999999:0=1"}) {
    INFO(bad);
    auto r = parse_routing_layers(bad, 2, 8);
    REQUIRE_FALSE(r.ok());
    CHECK(r.error().find("bad layer in '") != std::string::npos);
  }
  for (const char* bad : {"0:8=1", "0:1", "0:=1", "0:1=", "0:1=-1", "0:1=+1", "0:-1=1", "0:1=2=3",
                          "0:1=1,,2=1", "0:1=x", "0:1=99999999999999999999"}) {
    INFO(bad);
    auto r = parse_routing_layers(bad, 2, 8);
    REQUIRE_FALSE(r.ok());
    CHECK(r.error().find("bad expert=tokens '") != std::string::npos);
  }
  auto r = parse_routing_layers("0:" + std::string(100, '9'), 2, 8);
  REQUIRE_FALSE(r.ok());
  CHECK(r.error().find(std::string(41, '9')) == std::string::npos);
}
