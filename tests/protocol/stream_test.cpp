// Randomised streams (fixed seeds, bounded sizes): valid frames mixed with
// unknown commands, corrupt payloads and random splits must decode to exactly
// the expected events, and mutated streams must never crash the receiver.
#include <catch2/catch.hpp>
#include <random>
#include <vector>

#include "protocol/messages.h"
#include "sample_messages.h"

using namespace moe::protocol;
using moe::Result;
using moe::protocol::testing::frame_for;
using moe::protocol::testing::SampleMessages;

namespace {

enum class Kind { valid, unknown_command, corrupt_payload };

struct Sent {
  Kind kind;
  uint64_t request_id;
  Message message;  // for valid frames
};

// What a receiver does with each event: decode the frame's payload, or note
// the error. Returns false once the stream is fatal.
struct Receiver {
  std::vector<DecodeEvent> events;
  std::vector<Result<Message>> decoded;  // one per frame event, in order

  bool pump(FrameDecoder& d) {
    for (DecodeEvent ev = d.next(); ev.status != DecodeStatus::need_more; ev = d.next()) {
      if (ev.status == DecodeStatus::frame) decoded.push_back(decode_message(ev.frame));
      events.push_back(std::move(ev));
    }
    return !d.failed();
  }
};

}  // namespace

TEST_CASE("a random mix of valid, unknown and corrupt frames decodes exactly, in any split") {
  for (uint32_t seed = 1; seed <= 20; ++seed) {
    SampleMessages gen(seed);
    std::mt19937& rng = gen.rng();
    std::vector<Sent> sent;
    std::vector<uint8_t> stream;
    const size_t n_frames = gen.pick(20, 80);
    for (uint64_t id = 1; id <= n_frames; ++id) {
      const size_t roll = gen.pick(0, 9);
      if (roll < 6) {
        Message m = gen.any();
        auto f = frame_for(id, m);
        stream.insert(stream.end(), f.begin(), f.end());
        sent.push_back({Kind::valid, id, std::move(m)});
      } else if (roll < 8) {
        std::vector<uint8_t> payload(gen.pick(0, 64));
        for (auto& b : payload) b = static_cast<uint8_t>(rng());
        uint8_t cmd;
        do cmd = static_cast<uint8_t>(rng());
        while (is_known_command(cmd));
        REQUIRE(append_frame(stream, cmd, id, payload).ok());
        sent.push_back({Kind::unknown_command, id, Ping{}});
      } else {
        // A known command whose payload is a valid message's bytes with the
        // root offset pointed past the end: it cannot verify.
        Message m = gen.any();
        auto f = frame_for(id, m);
        f[kFrameHeaderBytes + 2] = 0x7F;
        f[kFrameHeaderBytes + 3] = 0x7F;
        stream.insert(stream.end(), f.begin(), f.end());
        sent.push_back({Kind::corrupt_payload, id, std::move(m)});
      }
    }

    FrameDecoder d;
    Receiver rx;
    for (size_t at = 0; at < stream.size();) {
      const size_t n = std::min(stream.size() - at, gen.pick(1, 700));
      d.feed(std::span<const uint8_t>(stream.data() + at, n));
      at += n;
      REQUIRE(rx.pump(d));
    }
    CHECK(d.partial_bytes() == 0);

    REQUIRE(rx.events.size() == sent.size());
    size_t frame_i = 0;
    for (size_t i = 0; i < sent.size(); ++i) {
      INFO("seed " << seed << " frame " << i);
      const DecodeEvent& ev = rx.events[i];
      switch (sent[i].kind) {
        case Kind::valid: {
          REQUIRE(ev.status == DecodeStatus::frame);
          CHECK(ev.frame.request_id == sent[i].request_id);
          const Result<Message>& m = rx.decoded[frame_i++];
          REQUIRE(m.ok());
          CHECK(*m == sent[i].message);
          break;
        }
        case Kind::unknown_command:
          REQUIRE(ev.status == DecodeStatus::error);
          CHECK_FALSE(ev.error.fatal);
          CHECK(ev.error.code == ErrorCode::unknown_command);
          CHECK(ev.error.request_id == sent[i].request_id);
          break;
        case Kind::corrupt_payload: {
          REQUIRE(ev.status == DecodeStatus::frame);
          CHECK(ev.frame.request_id == sent[i].request_id);
          CHECK_FALSE(rx.decoded[frame_i++].ok());
          break;
        }
      }
    }
  }
}

TEST_CASE("a randomly mutated stream never crashes and stops at the first fatal error") {
  for (uint32_t seed = 100; seed < 140; ++seed) {
    SampleMessages gen(seed);
    std::mt19937& rng = gen.rng();
    std::vector<uint8_t> stream;
    for (uint64_t id = 1, n = gen.pick(5, 30); id <= n; ++id) {
      auto f = frame_for(id, gen.any());
      stream.insert(stream.end(), f.begin(), f.end());
    }
    // Flip, overwrite, drop or insert bytes anywhere, headers included.
    for (size_t k = 0, n = gen.pick(1, 12); k < n && !stream.empty(); ++k) {
      const size_t at = gen.pick(0, stream.size() - 1);
      switch (gen.pick(0, 3)) {
        case 0: stream[at] ^= static_cast<uint8_t>(1u << gen.pick(0, 7)); break;
        case 1: stream[at] = static_cast<uint8_t>(rng()); break;
        case 2: stream.erase(stream.begin() + static_cast<long>(at)); break;
        default:
          stream.insert(stream.begin() + static_cast<long>(at), static_cast<uint8_t>(rng()));
          break;
      }
    }
    FrameDecoder d(size_t{1} << 20);
    Receiver rx;
    for (size_t at = 0; at < stream.size();) {
      const size_t n = std::min(stream.size() - at, gen.pick(1, 300));
      d.feed(std::span<const uint8_t>(stream.data() + at, n));
      at += n;
      rx.pump(d);
    }
    // Whatever came out is consistent: a fatal error, if any, is the last event.
    for (size_t i = 0; i < rx.events.size(); ++i) {
      if (rx.events[i].status == DecodeStatus::error && rx.events[i].error.fatal) {
        CHECK(i + 1 == rx.events.size());
        CHECK(d.failed());
      }
    }
    // A decoded frame never exceeds the bound.
    for (const DecodeEvent& ev : rx.events)
      if (ev.status == DecodeStatus::frame)
        CHECK(ev.frame.payload.size() + kFrameHeaderBytes <= (size_t{1} << 20));
  }
}

TEST_CASE("valid frames after a recoverable error are still decoded") {
  SampleMessages gen(7);
  std::vector<uint8_t> stream;
  REQUIRE(append_frame(stream, uint8_t{0x55}, 1, std::vector<uint8_t>(10, 0xEE)).ok());
  auto corrupt = frame_for(2, gen.step());
  corrupt[kFrameHeaderBytes] = 0xFF;
  corrupt[kFrameHeaderBytes + 3] = 0x7F;
  stream.insert(stream.end(), corrupt.begin(), corrupt.end());
  const StepRequest step = gen.step();
  auto good = frame_for(3, step);
  stream.insert(stream.end(), good.begin(), good.end());

  FrameDecoder d;
  d.feed(stream);
  Receiver rx;
  REQUIRE(rx.pump(d));
  REQUIRE(rx.events.size() == 3);
  CHECK(rx.events[0].status == DecodeStatus::error);
  CHECK(rx.events[0].error.request_id == 1);
  REQUIRE(rx.decoded.size() == 2);
  CHECK_FALSE(rx.decoded[0].ok());
  REQUIRE(rx.decoded[1].ok());
  CHECK(std::get<StepRequest>(*rx.decoded[1]) == step);
}
