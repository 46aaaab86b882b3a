#pragma once
// Framing of the gateway <-> worker byte stream:
//
//   [u32 length][u8 command][u64 request_id][payload: length - 9 bytes]
//
// little-endian; `length` counts the bytes after the length field itself
// (command + request id + payload), so an empty payload has length 9 and a
// whole frame is 4 + length bytes. See docs/protocol.md.

#include <cstddef>
#include <cstdint>
#include <deque>
#include <span>
#include <string>
#include <vector>

#include "model/result.h"
#include "protocol/codes.h"

namespace moe::protocol {

inline constexpr size_t kLengthFieldBytes = 4;
inline constexpr size_t kFrameHeaderBytes = 13;  // length + command + request id
// Smallest legal value of the length field: command + request id.
inline constexpr uint32_t kMinLengthField = kFrameHeaderBytes - kLengthFieldBytes;
// Default bound on a whole frame (header + payload), enforced by both ends.
inline constexpr size_t kMaxFrameBytes = size_t{64} << 20;
// Hard ceiling for any configured bound (the FlatBuffers verifier's limit is 2 GiB).
inline constexpr size_t kMaxFrameBytesCeiling = size_t{1} << 30;

// One complete frame. `payload` is its own allocation, so it is aligned for
// the FlatBuffers reader.
struct Frame {
  uint8_t command = 0;  // raw byte: always a known command when handed out by FrameDecoder
  uint64_t request_id = 0;
  std::vector<uint8_t> payload;
  bool operator==(const Frame&) const = default;
};

// Appends one frame to `out`. Fails (and appends nothing) when the frame
// would exceed `max_frame_bytes`, which the receiver would treat as fatal.
[[nodiscard]] Status append_frame(std::vector<uint8_t>& out, uint8_t command, uint64_t request_id,
                                  std::span<const uint8_t> payload,
                                  size_t max_frame_bytes = kMaxFrameBytes);
[[nodiscard]] Status append_frame(std::vector<uint8_t>& out, Command command, uint64_t request_id,
                                  std::span<const uint8_t> payload,
                                  size_t max_frame_bytes = kMaxFrameBytes);
// The same as a fresh buffer.
[[nodiscard]] Result<std::vector<uint8_t>> encode_frame(Command command, uint64_t request_id,
                                                        std::span<const uint8_t> payload,
                                                        size_t max_frame_bytes = kMaxFrameBytes);

// A problem found while cutting the stream into frames.
//  - fatal == false (unknown_command): the frame's bytes were skipped, the
//    stream is still in sync. Answer with an error frame naming request_id
//    and keep the connection.
//  - fatal == true (frame_too_large, frame_too_small): the length field
//    cannot be trusted, so frame boundaries are lost. Close the connection
//    (optionally after an error frame with request id 0). The decoder
//    ignores every later byte.
struct FrameError {
  bool fatal = false;
  ErrorCode code = ErrorCode::none;
  uint8_t command = 0;      // the offending frame's command byte (when read)
  uint64_t request_id = 0;  // the offending frame's request id (when read)
  std::string message;
};

enum class DecodeStatus {
  need_more,  // no complete frame buffered; feed more bytes
  frame,      // `frame` holds the next frame
  error,      // `error` holds the next error
};

struct DecodeEvent {
  DecodeStatus status = DecodeStatus::need_more;
  Frame frame;
  FrameError error;
};

// Incremental decoder for one connection: feed() the bytes of each read, in
// any split, then call next() until need_more. The length field is checked
// against the bound as soon as its 4 bytes arrive, before any payload
// memory is reserved; payload memory then grows only with bytes received.
// Not thread-safe: one decoder per connection, used by its reading thread.
class FrameDecoder {
 public:
  // `max_frame_bytes` bounds a whole frame (header + payload); it is clamped
  // to [kFrameHeaderBytes, kMaxFrameBytesCeiling].
  explicit FrameDecoder(size_t max_frame_bytes = kMaxFrameBytes);

  // Consumes `bytes`; completed frames and errors queue up for next().
  // After a fatal error every further byte is dropped.
  void feed(std::span<const uint8_t> bytes);

  // The oldest queued frame or error, or need_more.
  DecodeEvent next();

  // True once a fatal error was found (it is still delivered by next()).
  bool failed() const { return failed_; }
  size_t max_frame_bytes() const { return max_frame_bytes_; }
  // Bytes of the frame currently being received (header + payload so far).
  size_t partial_bytes() const;
  size_t queued_events() const { return events_.size(); }

 private:
  void finish_header();
  void finish_frame();

  size_t max_frame_bytes_;
  bool failed_ = false;
  uint8_t header_[kFrameHeaderBytes] = {};
  size_t header_have_ = 0;
  size_t payload_need_ = 0;  // payload bytes of the current frame
  Frame current_;
  std::deque<DecodeEvent> events_;
};

}  // namespace moe::protocol
