#include "protocol/frame.h"

#include <algorithm>
#include <cstdio>
#include <string>

namespace moe::protocol {

namespace {

void put_le(std::vector<uint8_t>& out, uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i) out.push_back(static_cast<uint8_t>(v >> (8 * i)));
}

uint64_t get_le(const uint8_t* p, int bytes) {
  uint64_t v = 0;
  for (int i = 0; i < bytes; ++i) v |= uint64_t{p[i]} << (8 * i);
  return v;
}

}  // namespace

bool is_known_command(uint8_t command) {
  switch (static_cast<Command>(command)) {
    case Command::load_expert:
    case Command::step:
    case Command::unload_expert:
    case Command::warm_hints:
    case Command::release_sequences:
    case Command::stats:
    case Command::shutdown:
    case Command::hello:
    case Command::ping:
    case Command::pong:
    case Command::load_expert_reply:
    case Command::step_reply:
    case Command::unload_expert_reply:
    case Command::stats_reply:
    case Command::pressure:
    case Command::error: return true;
  }
  return false;
}

const char* command_name(uint8_t command) {
  switch (static_cast<Command>(command)) {
    case Command::load_expert: return "load_expert";
    case Command::step: return "step";
    case Command::unload_expert: return "unload_expert";
    case Command::warm_hints: return "warm_hints";
    case Command::release_sequences: return "release_sequences";
    case Command::stats: return "stats";
    case Command::shutdown: return "shutdown";
    case Command::hello: return "hello";
    case Command::ping: return "ping";
    case Command::pong: return "pong";
    case Command::load_expert_reply: return "load_expert_reply";
    case Command::step_reply: return "step_reply";
    case Command::unload_expert_reply: return "unload_expert_reply";
    case Command::stats_reply: return "stats_reply";
    case Command::pressure: return "pressure";
    case Command::error: return "error";
  }
  return "unknown";
}

const char* error_code_name(ErrorCode code) {
  switch (code) {
    case ErrorCode::none: return "none";
    case ErrorCode::unknown_command: return "unknown_command";
    case ErrorCode::malformed_payload: return "malformed_payload";
    case ErrorCode::version_mismatch: return "version_mismatch";
    case ErrorCode::limit_exceeded: return "limit_exceeded";
    case ErrorCode::invalid_argument: return "invalid_argument";
    case ErrorCode::unknown_sequence: return "unknown_sequence";
    case ErrorCode::out_of_kv_blocks: return "out_of_kv_blocks";
    case ErrorCode::not_ready: return "not_ready";
    case ErrorCode::busy: return "busy";
    case ErrorCode::shutting_down: return "shutting_down";
    case ErrorCode::expert_unavailable: return "expert_unavailable";
    case ErrorCode::internal: return "internal";
    case ErrorCode::frame_too_large: return "frame_too_large";
    case ErrorCode::frame_too_small: return "frame_too_small";
  }
  return "unknown";
}

Status append_frame(std::vector<uint8_t>& out, uint8_t command, uint64_t request_id,
                    std::span<const uint8_t> payload, size_t max_frame_bytes) {
  const size_t limit = std::min(max_frame_bytes, kMaxFrameBytesCeiling);
  if (payload.size() > limit || kFrameHeaderBytes + payload.size() > limit) {
    return make_error(std::string("frame too large: ") + command_name(command) + " payload of " +
                      std::to_string(payload.size()) + " bytes exceeds the frame limit of " +
                      std::to_string(limit) + " bytes");
  }
  out.reserve(out.size() + kFrameHeaderBytes + payload.size());
  put_le(out, kMinLengthField + payload.size(), 4);
  out.push_back(command);
  put_le(out, request_id, 8);
  out.insert(out.end(), payload.begin(), payload.end());
  return {};
}

Status append_frame(std::vector<uint8_t>& out, Command command, uint64_t request_id,
                    std::span<const uint8_t> payload, size_t max_frame_bytes) {
  return append_frame(out, static_cast<uint8_t>(command), request_id, payload, max_frame_bytes);
}

Result<std::vector<uint8_t>> encode_frame(Command command, uint64_t request_id,
                                          std::span<const uint8_t> payload,
                                          size_t max_frame_bytes) {
  std::vector<uint8_t> out;
  Status st = append_frame(out, command, request_id, payload, max_frame_bytes);
  if (!st) return make_error(st.error());
  return out;
}

// ------------------------------------------------------------------ decoder

FrameDecoder::FrameDecoder(size_t max_frame_bytes)
    : max_frame_bytes_(std::clamp(max_frame_bytes, kFrameHeaderBytes, kMaxFrameBytesCeiling)) {}

size_t FrameDecoder::partial_bytes() const { return header_have_ + current_.payload.size(); }

void FrameDecoder::feed(std::span<const uint8_t> bytes) {
  size_t at = 0;
  while (at < bytes.size() && !failed_) {
    if (header_have_ < kFrameHeaderBytes) {
      // The length field is judged the moment its 4 bytes are in, so a
      // hostile length never waits for (or reserves) a payload.
      const size_t want = header_have_ < kLengthFieldBytes ? kLengthFieldBytes - header_have_
                                                           : kFrameHeaderBytes - header_have_;
      const size_t take = std::min(want, bytes.size() - at);
      std::copy_n(bytes.data() + at, take, header_ + header_have_);
      header_have_ += take;
      at += take;
      if (header_have_ == kLengthFieldBytes) {
        const uint64_t length = get_le(header_, 4);
        if (length < kMinLengthField) {
          failed_ = true;
          events_.push_back(
              {DecodeStatus::error,
               {},
               {true, ErrorCode::frame_too_small, 0, 0,
                "declared frame length " + std::to_string(length) + " is below the header size " +
                    std::to_string(kMinLengthField) + "; stream out of sync"}});
          break;
        }
        if (length + kLengthFieldBytes > max_frame_bytes_) {
          failed_ = true;
          events_.push_back(
              {DecodeStatus::error,
               {},
               {true, ErrorCode::frame_too_large, 0, 0,
                "declared frame length " + std::to_string(length) +
                    " exceeds the maximum frame of " + std::to_string(max_frame_bytes_) +
                    " bytes; stream out of sync"}});
          break;
        }
        payload_need_ = length - kMinLengthField;
      }
      if (header_have_ == kFrameHeaderBytes) finish_header();
      continue;
    }
    const size_t take = std::min(payload_need_ - current_.payload.size(), bytes.size() - at);
    current_.payload.insert(current_.payload.end(), bytes.data() + at, bytes.data() + at + take);
    at += take;
    if (current_.payload.size() == payload_need_) finish_frame();
  }
}

void FrameDecoder::finish_header() {
  current_.command = header_[4];
  current_.request_id = get_le(header_ + 5, 8);
  current_.payload.clear();
  // Reserve what is plausible now; a large payload grows as its bytes come.
  current_.payload.reserve(std::min<size_t>(payload_need_, size_t{64} << 10));
  if (payload_need_ == 0) finish_frame();
}

void FrameDecoder::finish_frame() {
  if (is_known_command(current_.command)) {
    events_.push_back({DecodeStatus::frame, std::move(current_), {}});
  } else {
    char hex[8];
    snprintf(hex, sizeof hex, "0x%02x", current_.command);
    events_.push_back({DecodeStatus::error,
                       {},
                       {false, ErrorCode::unknown_command, current_.command, current_.request_id,
                        std::string("unknown command ") + hex}});
  }
  current_ = Frame{};
  header_have_ = 0;
  payload_need_ = 0;
}

DecodeEvent FrameDecoder::next() {
  if (events_.empty()) return {};
  DecodeEvent ev = std::move(events_.front());
  events_.pop_front();
  return ev;
}

}  // namespace moe::protocol
