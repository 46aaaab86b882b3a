// The frame codec: byte layout, incremental decoding in any split, and the
// line between recoverable and fatal stream errors.
#include <catch2/catch.hpp>
#include <string>
#include <vector>

#include "protocol/frame.h"

using namespace moe::protocol;

namespace {

std::vector<uint8_t> frame_of(Command c, uint64_t id, std::vector<uint8_t> payload) {
  auto f = encode_frame(c, id, payload);
  REQUIRE(f.ok());
  return std::move(f).value();
}

// Everything the decoder hands out, in order.
std::vector<DecodeEvent> drain(FrameDecoder& d) {
  std::vector<DecodeEvent> out;
  for (DecodeEvent ev = d.next(); ev.status != DecodeStatus::need_more; ev = d.next())
    out.push_back(std::move(ev));
  return out;
}

}  // namespace

TEST_CASE("a frame is [u32 length][u8 command][u64 request id][payload], little-endian") {
  const std::vector<uint8_t> f = frame_of(Command::step, 0x0102030405060708ull, {0xAA, 0xBB, 0xCC});
  const std::vector<uint8_t> expected = {12,   0,    0,    0,  // length: 1 + 8 + 3 payload bytes
                                         0x02,                 // step
                                         0x08, 0x07, 0x06, 0x05,
                                         0x04, 0x03, 0x02, 0x01,  // request id
                                         0xAA, 0xBB, 0xCC};
  CHECK(f == expected);
  CHECK(kFrameHeaderBytes == 13);

  const std::vector<uint8_t> empty = frame_of(Command::ping, 1, {});
  CHECK(empty.size() == kFrameHeaderBytes);
  CHECK(empty[0] == kMinLengthField);
}

TEST_CASE("append_frame puts several frames in one buffer") {
  std::vector<uint8_t> buf;
  REQUIRE(append_frame(buf, Command::ping, 1, std::vector<uint8_t>{1}).ok());
  REQUIRE(append_frame(buf, Command::pong, 2, std::vector<uint8_t>{2, 3}).ok());
  CHECK(buf.size() == 2 * kFrameHeaderBytes + 3);
  FrameDecoder d;
  d.feed(buf);
  auto evs = drain(d);
  REQUIRE(evs.size() == 2);
  CHECK(evs[0].frame.command == uint8_t(Command::ping));
  CHECK(evs[1].frame.request_id == 2);
  CHECK(evs[1].frame.payload == std::vector<uint8_t>{2, 3});
}

TEST_CASE("the encoder refuses a frame the receiver would reject") {
  std::vector<uint8_t> payload(100 - kFrameHeaderBytes + 1);
  auto too_big = encode_frame(Command::step, 1, payload, 100);
  REQUIRE_FALSE(too_big.ok());
  CHECK(too_big.error().find("frame too large") != std::string::npos);
  payload.pop_back();
  CHECK(encode_frame(Command::step, 1, payload, 100).ok());
}

TEST_CASE("frames delivered one byte at a time come out whole and in order") {
  std::vector<uint8_t> stream;
  for (uint64_t id = 1; id <= 5; ++id) {
    std::vector<uint8_t> payload(id * 7, static_cast<uint8_t>(id));
    auto f = frame_of(id % 2 ? Command::step : Command::hello, id, payload);
    stream.insert(stream.end(), f.begin(), f.end());
  }
  FrameDecoder d;
  std::vector<DecodeEvent> evs;
  for (size_t i = 0; i < stream.size(); ++i) {
    d.feed(std::span<const uint8_t>(&stream[i], 1));
    for (auto& ev : drain(d)) evs.push_back(std::move(ev));
  }
  REQUIRE(evs.size() == 5);
  for (uint64_t id = 1; id <= 5; ++id) {
    const DecodeEvent& ev = evs[id - 1];
    REQUIRE(ev.status == DecodeStatus::frame);
    CHECK(ev.frame.request_id == id);
    CHECK(ev.frame.command == uint8_t(id % 2 ? Command::step : Command::hello));
    CHECK(ev.frame.payload == std::vector<uint8_t>(id * 7, static_cast<uint8_t>(id)));
  }
  CHECK(d.partial_bytes() == 0);
}

TEST_CASE("many frames coalesced in one read all come out") {
  std::vector<uint8_t> stream;
  for (uint64_t id = 0; id < 1000; ++id) {
    auto f = frame_of(Command::ping, id, {static_cast<uint8_t>(id), 0x5A});
    stream.insert(stream.end(), f.begin(), f.end());
  }
  FrameDecoder d;
  d.feed(stream);
  CHECK(d.queued_events() == 1000);
  auto evs = drain(d);
  REQUIRE(evs.size() == 1000);
  for (uint64_t id = 0; id < 1000; ++id) {
    CHECK(evs[id].frame.request_id == id);
    CHECK(evs[id].frame.payload[0] == static_cast<uint8_t>(id));
  }
}

TEST_CASE("a truncated frame yields nothing until its last byte arrives") {
  const auto f = frame_of(Command::step, 77, std::vector<uint8_t>(300, 1));
  FrameDecoder d;
  for (size_t cut : {size_t{1}, size_t{4}, size_t{12}, size_t{13}, f.size() - 1}) {
    FrameDecoder part;
    part.feed(std::span<const uint8_t>(f.data(), cut));
    CHECK(part.next().status == DecodeStatus::need_more);
    CHECK_FALSE(part.failed());
    CHECK(part.partial_bytes() == cut);
  }
  d.feed(std::span<const uint8_t>(f.data(), f.size() - 1));
  CHECK(d.next().status == DecodeStatus::need_more);
  d.feed(std::span<const uint8_t>(f.data() + f.size() - 1, 1));
  DecodeEvent ev = d.next();
  REQUIRE(ev.status == DecodeStatus::frame);
  CHECK(ev.frame.request_id == 77);
  CHECK(ev.frame.payload.size() == 300);
}

TEST_CASE("an oversized declared length is fatal as soon as the length field arrives") {
  FrameDecoder d;  // default bound: kMaxFrameBytes
  // length = kMaxFrameBytes, so 4 + length exceeds the bound by 4 bytes.
  const uint32_t length = static_cast<uint32_t>(kMaxFrameBytes);
  const uint8_t header[4] = {uint8_t(length), uint8_t(length >> 8), uint8_t(length >> 16),
                             uint8_t(length >> 24)};
  d.feed(header);
  DecodeEvent ev = d.next();
  REQUIRE(ev.status == DecodeStatus::error);
  CHECK(ev.error.fatal);
  CHECK(ev.error.code == ErrorCode::frame_too_large);
  CHECK(d.failed());
  // Nothing was reserved for the payload, and later bytes are ignored.
  CHECK(d.partial_bytes() == 4);
  d.feed(frame_of(Command::ping, 1, {}));
  CHECK(d.next().status == DecodeStatus::need_more);
  CHECK(d.partial_bytes() == 4);
}

TEST_CASE("the frame bound is configurable per decoder and inclusive") {
  FrameDecoder d(64);
  CHECK(d.max_frame_bytes() == 64);
  d.feed(frame_of(Command::step, 1, std::vector<uint8_t>(64 - kFrameHeaderBytes, 9)));
  CHECK(d.next().status == DecodeStatus::frame);
  d.feed(frame_of(Command::step, 2, std::vector<uint8_t>(64 - kFrameHeaderBytes + 1, 9)));
  DecodeEvent ev = d.next();
  REQUIRE(ev.status == DecodeStatus::error);
  CHECK(ev.error.code == ErrorCode::frame_too_large);
  CHECK(ev.error.fatal);

  CHECK(FrameDecoder(size_t{1} << 40).max_frame_bytes() == kMaxFrameBytesCeiling);
  CHECK(FrameDecoder(0).max_frame_bytes() == kFrameHeaderBytes);
}

TEST_CASE("a declared length below the header size is fatal") {
  for (uint8_t length : {0, 1, 8}) {
    FrameDecoder d;
    d.feed(std::vector<uint8_t>{length, 0, 0, 0, 0x02, 1, 0, 0, 0, 0, 0, 0, 0});
    DecodeEvent ev = d.next();
    REQUIRE(ev.status == DecodeStatus::error);
    CHECK(ev.error.fatal);
    CHECK(ev.error.code == ErrorCode::frame_too_small);
    CHECK(d.next().status == DecodeStatus::need_more);
  }
}

TEST_CASE("garbage such as an HTTP request is fatal, not a 500 MB allocation") {
  const std::string http = "GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n";
  FrameDecoder d;
  d.feed(std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(http.data()), http.size()));
  DecodeEvent ev = d.next();
  REQUIRE(ev.status == DecodeStatus::error);
  CHECK(ev.error.fatal);
  CHECK(ev.error.code == ErrorCode::frame_too_large);
  CHECK(d.next().status == DecodeStatus::need_more);
}

TEST_CASE("an unknown command is a recoverable error naming its request id") {
  std::vector<uint8_t> stream;
  std::vector<uint8_t> unknown;
  REQUIRE(append_frame(unknown, uint8_t{0x42}, 31337, std::vector<uint8_t>{1, 2, 3, 4}).ok());
  stream.insert(stream.end(), unknown.begin(), unknown.end());
  const auto good = frame_of(Command::stats, 31338, {7});
  stream.insert(stream.end(), good.begin(), good.end());

  FrameDecoder d;
  d.feed(stream);
  DecodeEvent bad = d.next();
  REQUIRE(bad.status == DecodeStatus::error);
  CHECK_FALSE(bad.error.fatal);
  CHECK(bad.error.code == ErrorCode::unknown_command);
  CHECK(bad.error.request_id == 31337);
  CHECK(bad.error.command == 0x42);
  CHECK(bad.error.message.find("0x42") != std::string::npos);
  CHECK_FALSE(d.failed());

  DecodeEvent next = d.next();
  REQUIRE(next.status == DecodeStatus::frame);
  CHECK(next.frame.request_id == 31338);
  CHECK(next.frame.payload == std::vector<uint8_t>{7});
}

TEST_CASE("every command byte in the table is known and named, others are not") {
  int known = 0;
  for (int c = 0; c < 256; ++c) {
    const bool k = is_known_command(static_cast<uint8_t>(c));
    known += k;
    CHECK(k == (std::string(command_name(static_cast<uint8_t>(c))) != "unknown"));
  }
  CHECK(known == 16);
  CHECK(std::string(command_name(0x01)) == "load_expert");
  CHECK(std::string(command_name(0x02)) == "step");
  CHECK(std::string(command_name(0x03)) == "unload_expert");
  CHECK_FALSE(is_known_command(0x00));
}
