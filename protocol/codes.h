#pragma once
// The numbers on the wire: protocol version, command bytes and error codes.
// docs/protocol.md holds the same table with directions and payloads.

#include <cstdint>

namespace moe::protocol {

// Sent in hello; a peer with another version is refused (error frame
// version_mismatch, then close).
inline constexpr uint32_t kProtocolVersion = 2;  // 2: sampling penalties, biases, min_p

// The command byte of a frame. Requests have the high bit clear; the reply to
// request X is X | 0x80 where one exists. G = gateway, W = worker.
enum class Command : uint8_t {
  load_expert = 0x01,          // G->W  LoadExpert        reply load_expert_reply
  step = 0x02,                 // G->W  StepRequest       reply step_reply
  unload_expert = 0x03,        // G->W  UnloadExpert      reply unload_expert_reply
  warm_hints = 0x04,           // G->W  WarmHints         no reply
  release_sequences = 0x05,    // G->W  ReleaseSequences  no reply
  stats = 0x06,                // G->W  StatsRequest      reply stats_reply
  shutdown = 0x07,             // G->W  Shutdown          no reply; W closes
  hello = 0x10,                // both  Hello             W answers G's hello with its own
  ping = 0x11,                 // both  Ping              reply pong
  pong = 0x12,                 // both  Pong
  load_expert_reply = 0x81,    // W->G  LoadExpertReply
  step_reply = 0x82,           // W->G  StepReply
  unload_expert_reply = 0x83,  // W->G  UnloadExpertReply
  stats_reply = 0x86,          // W->G  StatsReply
  pressure = 0x90,             // W->G  Pressure          unsolicited, request id 0
  error = 0xFF,                // both  ErrorReport       answers a frame by its request id
};

// True for the command bytes above; anything else is an unknown command.
bool is_known_command(uint8_t command);
// "step", "hello", ... or "unknown".
const char* command_name(uint8_t command);

// Mirrors moe.fb.ErrorCode (checked at compile time in messages.cpp).
// Values a newer peer adds arrive unchanged as their number.
enum class ErrorCode : uint16_t {
  none = 0,
  unknown_command = 1,    // recoverable: frame skipped, connection kept
  malformed_payload = 2,  // recoverable: payload failed verification or a limit
  version_mismatch = 3,   // hello refused; the connection is closed after
  limit_exceeded = 4,
  invalid_argument = 5,
  unknown_sequence = 6,
  out_of_kv_blocks = 7,
  not_ready = 8,
  busy = 9,
  shutting_down = 10,
  expert_unavailable = 11,
  internal = 12,
  frame_too_large = 13,  // fatal: stream out of sync, close
  frame_too_small = 14,  // fatal: stream out of sync, close
};

const char* error_code_name(ErrorCode code);

}  // namespace moe::protocol
