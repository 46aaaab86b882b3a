// Typed messages: every command survives a trip through frame + payload,
// payloads written by flatc itself decode to the values in their JSON, and
// malformed or out-of-limit payloads become recoverable errors.
#include <catch2/catch.hpp>
#include <cmath>
#include <fstream>
#include <iterator>
#include <limits>
#include <string>
#include <vector>

#include "protocol/messages.h"
#include "sample_messages.h"

using namespace moe::protocol;
using moe::protocol::testing::frame_for;
using moe::protocol::testing::SampleMessages;

namespace {

std::vector<uint8_t> read_golden(const std::string& name) {
  std::ifstream in(std::string(MOE_PROTOCOL_GOLDEN_DIR) + "/" + name, std::ios::binary);
  REQUIRE(in.good());
  return std::vector<uint8_t>(std::istreambuf_iterator<char>(in), {});
}

Frame single_frame(const std::vector<uint8_t>& bytes) {
  FrameDecoder d;
  d.feed(bytes);
  DecodeEvent ev = d.next();
  REQUIRE(ev.status == DecodeStatus::frame);
  REQUIRE(d.next().status == DecodeStatus::need_more);
  return ev.frame;
}

StepRequest one_sequence_step() {
  StepRequest s;
  StepSequence q;
  q.seq_id = 5;
  q.tokens = {1, 2, 3};
  s.sequences.push_back(q);
  return s;
}

std::string step_error(const StepRequest& s) {
  auto r = decode_step(encode_step(s));
  REQUIRE_FALSE(r.ok());
  return r.error();
}

}  // namespace

TEST_CASE("every command round-trips through frame and payload") {
  for (uint32_t seed : {1u, 2u, 3u, 4u, 5u}) {
    SampleMessages gen(seed);
    uint64_t id = 100 * seed;
    for (const Message& m : gen.one_of_each()) {
      ++id;
      const Frame f = single_frame(frame_for(id, m));
      CHECK(f.request_id == id);
      CHECK(f.command == static_cast<uint8_t>(command_of(m)));
      auto back = decode_message(f);
      REQUIRE(back.ok());
      CHECK(back->index() == m.index());
      CHECK(*back == m);
      CHECK(testing::frame_for_variant(id, m) == frame_for(id, m));
    }
  }
}

TEST_CASE("each message type maps to its fixed command byte") {
  CHECK(command_of(LoadExpert{}) == Command::load_expert);
  CHECK(static_cast<int>(Command::load_expert) == 0x01);
  CHECK(command_of(StepRequest{}) == Command::step);
  CHECK(static_cast<int>(Command::step) == 0x02);
  CHECK(command_of(UnloadExpert{}) == Command::unload_expert);
  CHECK(static_cast<int>(Command::unload_expert) == 0x03);
  CHECK(command_of(StepReply{}) == Command::step_reply);
  CHECK(command_of(Hello{}) == Command::hello);
  CHECK(command_of(ErrorReport{}) == Command::error);
}

TEST_CASE("a hello written by flatc from JSON decodes to the JSON's values") {
  auto h = decode_hello(read_golden("hello.bin"));
  REQUIRE(h.ok());
  CHECK(h->protocol_version == 2);
  CHECK(h->role == Role::worker);
  CHECK(h->model_id == "demo-moe");
  CHECK(h->backend == "cuda");
  CHECK(h->instance == "worker-0");
  CHECK(h->kv_blocks_total == 4096);
  CHECK(h->kv_block_tokens == 16);
  CHECK(h->max_context == 32768);
  CHECK(h->vram_budget_bytes == 12884901888ull);
  CHECK(h->islands_total == 240);
  CHECK(h->max_batch_sequences == 64);
  CHECK(h->max_step_tokens == 2048);
  CHECK(h->experts.n_layers == 4);
  CHECK(h->experts.n_moe_layers == 3);
  CHECK(h->experts.n_experts == 8);
  CHECK(h->experts.top_k == 2);
  CHECK(h->experts.expert_blob_bytes == 1572864);
  CHECK(h->experts.moe_layers == std::vector<uint16_t>{1, 2, 3});
  CHECK(h->vocab_size == 151936);
  CHECK(h->eos_ids == std::vector<int32_t>{151643, 151645});
  CHECK(check_version(*h).ok());
}

TEST_CASE("a step written by flatc decodes with the schema's defaults filled in") {
  auto s = decode_step(read_golden("step.bin"));
  REQUIRE(s.ok());
  CHECK(s->report_expert_usage);  // absent in the JSON: schema default true
  REQUIRE(s->sequences.size() == 2);
  const StepSequence& a = s->sequences[0];
  CHECK(a.seq_id == 7);
  CHECK(a.tokens == std::vector<int32_t>{151644, 872, 198});
  CHECK(a.start_pos == 0);
  CHECK_FALSE(a.sample);
  CHECK(a.sampling.temperature == 0.0f);
  CHECK(a.sampling.top_p == 1.0f);  // absent: default
  CHECK(a.sampling.seed == 42);
  CHECK(a.route_bucket == 0);  // written before the field existed: none
  const StepSequence& b = s->sequences[1];
  CHECK(b.seq_id == 9000000000ull);
  CHECK(b.tokens == std::vector<int32_t>{13});
  CHECK(b.start_pos == 120);
  CHECK(b.sample);
  CHECK(b.sampling.temperature == 0.7f);
  CHECK(b.sampling.top_p == 0.9f);
  CHECK(b.sampling.top_k == 40);
  CHECK(b.sampling.seed == 3);
  CHECK(b.sampling.logprobs);
  CHECK(b.sampling.top_logprobs == 5);
  CHECK(b.sampling.repetition_penalty == 1.3f);
  CHECK(b.sampling.presence_penalty == 0.5f);
  CHECK(b.sampling.frequency_penalty == -0.25f);
  CHECK(b.sampling.min_p == 0.05f);
  REQUIRE(b.sampling.adjust.size() == 2);
  CHECK((b.sampling.adjust[0] == moe::TokenAdjust{13, 2.5f, 3, 1}));
  CHECK(b.sampling.adjust[1].token == 151643);
  CHECK(b.sampling.adjust[1].bias == -std::numeric_limits<float>::infinity());
  CHECK(b.sampling.adjust[1].output_count == 0);
  CHECK(b.sampling.adjust[1].in_prompt == 0);
  // Absent (a version-1 writer): no penalties, no list.
  CHECK(a.sampling.repetition_penalty == 1.0f);
  CHECK(a.sampling.presence_penalty == 0.0f);
  CHECK(a.sampling.min_p == 0.0f);
  CHECK(a.sampling.adjust.empty());
}

TEST_CASE("a step sequence's route bucket round-trips; without one it reads 0") {
  StepRequest s = one_sequence_step();
  s.sequences[0].route_bucket = 0x8001000000000abcull;
  auto back = decode_step(encode_step(s));
  REQUIRE(back.ok());
  CHECK(back->sequences[0].route_bucket == 0x8001000000000abcull);
  auto none = decode_step(encode_step(one_sequence_step()));
  REQUIRE(none.ok());
  CHECK(none->sequences[0].route_bucket == 0);
}

TEST_CASE("a step reply written by flatc decodes, per-sequence errors included") {
  auto r = decode_step_reply(read_golden("step_reply.bin"));
  REQUIRE(r.ok());
  REQUIRE(r->results.size() == 2);
  CHECK(r->results[0].seq_id == 7);
  CHECK(r->results[0].error == ErrorCode::none);
  CHECK_FALSE(r->results[0].sampled);
  CHECK(r->results[0].kv_tokens == 3);
  CHECK(r->results[0].expert_usage == std::vector<uint16_t>{0, 3, 0, 3, 0, 0, 0, 0});
  CHECK(r->results[1].error == ErrorCode::out_of_kv_blocks);
  CHECK(r->results[1].error_message == "no free KV block");
  CHECK(r->timing.total_us == 1500);
  CHECK(r->timing.queue_us == 0);
  CHECK(r->timing.compute_us == 1200);
  CHECK(r->timing.expert_wait_us == 250);
  CHECK(r->kv_blocks_used == 10);
  CHECK(r->kv_blocks_free == 4086);
  CHECK(r->expert_hits == 5);
  CHECK(r->expert_misses == 1);
}

TEST_CASE("our encoder writes the same step bytes a reader of the schema expects") {
  // Re-encode the flatc-written step and decode it again: nothing is lost.
  auto s = decode_step(read_golden("step.bin"));
  REQUIRE(s.ok());
  auto again = decode_step(encode_step(*s));
  REQUIRE(again.ok());
  CHECK(*again == *s);
  StepRequest off = *s;
  off.report_expert_usage = false;
  CHECK_FALSE(decode_step(encode_step(off))->report_expert_usage);
}

TEST_CASE("a protocol version mismatch is reported with both versions") {
  Hello h;
  h.protocol_version = kProtocolVersion + 1;
  auto back = decode_hello(encode_hello(h));
  REQUIRE(back.ok());  // decodes, so the receiver can answer version_mismatch
  moe::Status st = check_version(*back);
  REQUIRE_FALSE(st.ok());
  CHECK(st.error().find(std::to_string(kProtocolVersion + 1)) != std::string::npos);
  CHECK(st.error().find(std::to_string(kProtocolVersion)) != std::string::npos);
}

TEST_CASE("a payload that fails verification is a recoverable error naming the request id") {
  const std::vector<uint8_t> good = encode_step(one_sequence_step());
  SECTION("root offset pointing past the end") {
    std::vector<uint8_t> bad = good;
    bad[0] = 0xF0;
    bad[1] = 0xFF;
    auto r = decode_step(bad);
    REQUIRE_FALSE(r.ok());
    CHECK(r.error().find("verification") != std::string::npos);
  }
  SECTION("truncated at every length") {
    for (size_t n = 0; n < good.size(); ++n) {
      auto r = decode_step(std::span<const uint8_t>(good.data(), n));
      CHECK_FALSE(r.ok());
    }
  }
  SECTION("through decode_message and back as an error frame") {
    std::vector<uint8_t> bad = good;
    bad[0] = 0xF0;
    auto frame = encode_frame(Command::step, 4242, bad);
    REQUIRE(frame.ok());
    const Frame f = single_frame(*frame);
    auto m = decode_message(f);
    REQUIRE_FALSE(m.ok());
    const Frame reply = single_frame(
        make_error_frame(f.request_id, f.command, ErrorCode::malformed_payload, m.error()));
    CHECK(reply.command == static_cast<uint8_t>(Command::error));
    CHECK(reply.request_id == 4242);
    auto e = decode_error(reply.payload);
    REQUIRE(e.ok());
    CHECK(e->code == ErrorCode::malformed_payload);
    CHECK(e->command == static_cast<uint8_t>(Command::step));
    CHECK(e->request_id == 4242);
    CHECK(e->message == m.error());
  }
}

TEST_CASE("a payload not aligned in memory still decodes") {
  SampleMessages gen(9);
  const StepReply reply = gen.step_reply();
  const std::vector<uint8_t> payload = encode_step_reply(reply);
  std::vector<uint8_t> shifted(payload.size() + 3);
  std::copy(payload.begin(), payload.end(), shifted.begin() + 3);
  auto r = decode_step_reply(std::span<const uint8_t>(shifted.data() + 3, payload.size()));
  REQUIRE(r.ok());
  CHECK(*r == reply);
}

TEST_CASE("step sanity limits are refused with a message") {
  SECTION("no sequences") {
    CHECK(step_error(StepRequest{}).find("no sequences") != std::string::npos);
  }
  SECTION("a sequence without tokens") {
    StepRequest s = one_sequence_step();
    s.sequences[0].tokens.clear();
    CHECK(step_error(s).find("no tokens") != std::string::npos);
  }
  SECTION("sequence id 0") {
    StepRequest s = one_sequence_step();
    s.sequences[0].seq_id = 0;
    CHECK(step_error(s).find("reserved") != std::string::npos);
  }
  SECTION("the same sequence twice") {
    StepRequest s = one_sequence_step();
    s.sequences.push_back(s.sequences[0]);
    CHECK(step_error(s).find("twice") != std::string::npos);
  }
  SECTION("too many tokens in one step") {
    StepRequest s = one_sequence_step();
    s.sequences[0].tokens.assign(kMaxStepTokens, 1);
    CHECK(decode_step(encode_step(s)).ok());
    StepSequence more;
    more.seq_id = 6;
    more.tokens = {1};
    s.sequences.push_back(more);
    CHECK(step_error(s).find("tokens in one step") != std::string::npos);
  }
  SECTION("too many sequences") {
    StepRequest s;
    for (uint64_t i = 1; i <= kMaxStepSequences + 1; ++i)
      s.sequences.push_back({i, {1}, 0, true, {}});
    CHECK(step_error(s).find("sequences has") != std::string::npos);
  }
  SECTION("negative token id") {
    StepRequest s = one_sequence_step();
    s.sequences[0].tokens[1] = -3;
    CHECK(step_error(s).find("negative token") != std::string::npos);
  }
  SECTION("positions past 2^32") {
    StepRequest s = one_sequence_step();
    s.sequences[0].start_pos = std::numeric_limits<uint32_t>::max() - 1;
    CHECK(step_error(s).find("2^32") != std::string::npos);
  }
  SECTION("sampling parameters out of range") {
    StepRequest s = one_sequence_step();
    s.sequences[0].sampling.temperature = std::nanf("");
    CHECK(step_error(s).find("temperature") != std::string::npos);
    s = one_sequence_step();
    s.sequences[0].sampling.temperature = -1.0f;
    CHECK(step_error(s).find("temperature") != std::string::npos);
    s = one_sequence_step();
    s.sequences[0].sampling.top_p = 0.0f;
    CHECK(step_error(s).find("top_p") != std::string::npos);
    s = one_sequence_step();
    s.sequences[0].sampling.top_logprobs = kMaxTopLogprobs + 1;
    CHECK(step_error(s).find("top_logprobs") != std::string::npos);
    s = one_sequence_step();
    s.sequences[0].sampling.repetition_penalty = 0.0f;
    CHECK(step_error(s).find("repetition_penalty") != std::string::npos);
    s = one_sequence_step();
    s.sequences[0].sampling.frequency_penalty = std::numeric_limits<float>::infinity();
    CHECK(step_error(s).find("frequency_penalty") != std::string::npos);
    s = one_sequence_step();
    s.sequences[0].sampling.min_p = 1.5f;
    CHECK(step_error(s).find("min_p") != std::string::npos);
  }
  SECTION("token adjustments: sorted, distinct, bounded, biases finite or -inf") {
    StepRequest s = one_sequence_step();
    s.sequences[0].sampling.adjust = {{5, 1.0f, 0, 0}, {5, 2.0f, 0, 0}};
    CHECK(step_error(s).find("sorted") != std::string::npos);
    s.sequences[0].sampling.adjust = {{9, 1.0f, 0, 0}, {4, 2.0f, 0, 0}};
    CHECK(step_error(s).find("sorted") != std::string::npos);
    s.sequences[0].sampling.adjust = {{-1, 1.0f, 0, 0}};
    CHECK(step_error(s).find("sorted") != std::string::npos);
    s.sequences[0].sampling.adjust = {{4, std::numeric_limits<float>::infinity(), 0, 0}};
    CHECK(step_error(s).find("finite or -inf") != std::string::npos);
    s.sequences[0].sampling.adjust = {{4, std::nanf(""), 0, 0}};
    CHECK(step_error(s).find("finite or -inf") != std::string::npos);
    s.sequences[0].sampling.adjust.clear();
    for (int32_t t = 0; t <= int32_t(kMaxTokenAdjust); ++t) s.sequences[0].sampling.adjust.push_back({t, 1.0f, 0, 0});
    CHECK(step_error(s).find("adjust") != std::string::npos);
    s.sequences[0].sampling.adjust.pop_back();
    CHECK(decode_step(encode_step(s)).ok());
  }
  SECTION("a mask of allowed tokens names at least one and is bounded") {
    StepRequest s = one_sequence_step();
    s.sequences[0].sampling.allowed = {0u, 0u};
    CHECK(step_error(s).find("names no token") != std::string::npos);
    s.sequences[0].sampling.allowed.assign(kMaxAllowedWords + 1, 1u);
    CHECK(step_error(s).find("allowed") != std::string::npos);
    s.sequences[0].sampling.allowed.assign(kMaxAllowedWords, 0u);
    s.sequences[0].sampling.allowed.back() = 1u << 31;
    auto back = decode_step(encode_step(s));
    REQUIRE(back.ok());
    CHECK(back->sequences[0].sampling.allowed == s.sequences[0].sampling.allowed);
  }
}

TEST_CASE("other messages' limits and enums are checked") {
  SECTION("hello: moe_layers must agree with n_moe_layers and n_layers") {
    Hello h;
    h.experts.n_layers = 4;
    h.experts.n_moe_layers = 2;
    h.experts.moe_layers = {1};
    CHECK_FALSE(decode_hello(encode_hello(h)).ok());
    h.experts.moe_layers = {1, 4};
    CHECK_FALSE(decode_hello(encode_hello(h)).ok());
    h.experts.moe_layers = {1, 3};
    CHECK(decode_hello(encode_hello(h)).ok());
    h.eos_ids.assign(kMaxEosIds + 1, 2);
    CHECK(decode_hello(encode_hello(h)).error().find("eos_ids") != std::string::npos);
  }
  SECTION("release: list size") {
    ReleaseSequences r;
    r.seq_ids.assign(kMaxReleaseSequences, 1);
    CHECK(decode_release_sequences(encode_release_sequences(r)).ok());
    r.seq_ids.push_back(2);
    CHECK_FALSE(decode_release_sequences(encode_release_sequences(r)).ok());
  }
  SECTION("hints: priorities must be finite") {
    WarmHints w;
    w.hints = {{1, 2, 0.5f}, {1, 3, std::numeric_limits<float>::infinity()}};
    CHECK(decode_warm_hints(encode_warm_hints(w)).error().find("priority") != std::string::npos);
  }
  SECTION("unknown enum values from a confused peer") {
    Pressure p;
    p.level = static_cast<PressureLevel>(7);
    CHECK(decode_pressure(encode_pressure(p)).error().find("level") != std::string::npos);
    Shutdown s;
    s.mode = static_cast<ShutdownMode>(9);
    CHECK(decode_shutdown(encode_shutdown(s)).error().find("mode") != std::string::npos);
    Hello h;
    h.role = static_cast<Role>(5);
    CHECK(decode_hello(encode_hello(h)).error().find("role") != std::string::npos);
  }
  SECTION("strings are cut to the limit by the writer, an error message never refused") {
    ErrorReport e{ErrorCode::internal, 2, 9, std::string(kMaxStringBytes * 3, 'x')};
    auto back = decode_error(encode_error(e));
    REQUIRE(back.ok());
    CHECK(back->message.size() == kMaxStringBytes);
    const Frame f = single_frame(make_error_frame(9, 2, ErrorCode::internal, e.message));
    CHECK(decode_error(f.payload)->message.size() == kMaxStringBytes);
  }
}

TEST_CASE("a payload sent under the wrong command never crashes, and what it accepts is stable") {
  // The command byte alone picks the table, so a mislabelled payload may
  // verify as another table; it must then still satisfy that table's limits
  // and survive a re-encode unchanged.
  SampleMessages gen(11);
  const std::vector<Message> all = gen.one_of_each();
  size_t accepted = 0;
  for (const Message& m : all) {
    const Frame original = single_frame(frame_for(1, m));
    for (const Message& as : all) {
      Frame f = original;
      f.command = static_cast<uint8_t>(command_of(as));
      auto got = decode_message(f);
      if (!got.ok()) continue;
      ++accepted;
      auto again = decode_message(single_frame(frame_for(1, *got)));
      REQUIRE(again.ok());
      CHECK(*again == *got);
    }
  }
  CHECK(accepted >= all.size());  // at least every payload under its own command
  CHECK_FALSE(decode_step(encode_hello(gen.hello())).ok());
}

TEST_CASE("a step reply of a big batch with expert usage fits a frame") {
  // 64 sequences x 24 MoE layers x 64 experts of u16 counts, top-20 logprobs.
  StepReply r;
  for (uint64_t i = 1; i <= 64; ++i) {
    StepResult s;
    s.seq_id = i;
    s.sampled = true;
    s.top.assign(20, {1, -1.0f});
    s.expert_usage.assign(24 * 64, 1);
    r.results.push_back(std::move(s));
  }
  auto f = make_frame(1, r);
  REQUIRE(f.ok());
  CHECK(f->size() < 300 * 1024);
  auto back = decode_step_reply(
      std::span<const uint8_t>(f->data() + kFrameHeaderBytes, f->size() - kFrameHeaderBytes));
  REQUIRE(back.ok());
  CHECK(*back == r);
}
