#pragma once
// Plain C++ messages of the gateway <-> worker protocol and their codecs.
// The gateway and the worker use only these structs; the FlatBuffers code
// generated from protocol/moe.fbs stays inside messages.cpp.
//
// encode_X(msg) -> payload bytes (always succeeds).
// decode_X(payload) -> Result<X>: runs the FlatBuffers verifier (depth and
//   table limits) and then the sanity limits below; a failure is a
//   recoverable error: answer with error frame malformed_payload (or
//   limit_exceeded) naming the frame's request id, keep the connection.
// make_frame(request_id, msg) -> a whole frame with the right command byte.
// decode_message(frame) -> the typed message of any known command.
//
// Expert addresses (LoadExpert.layer, ExpertRef, ExpertHint) use the model's
// layer index; expert_usage rows follow ExpertLayout.moe_layers order.

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "kernels/logit_adjust.h"
#include "model/result.h"
#include "protocol/codes.h"
#include "protocol/frame.h"

namespace moe::protocol {

// ------------------------------------------------------------ sanity limits
// Checked by every decode; far above what a sane peer sends, low enough that
// a hostile frame cannot make the receiver do unbounded work.
inline constexpr size_t kMaxStepSequences = 4096;
inline constexpr size_t kMaxStepTokens = 65535;  // per step, all sequences (u16 usage counts)
inline constexpr size_t kMaxTopLogprobs = 20;
inline constexpr size_t kMaxTokenAdjust = 1 << 17;  // SamplingParams::adjust, per sequence
inline constexpr size_t kMaxAllowedWords = 1 << 16;  // SamplingParams::allowed: vocabularies up to 2^21
inline constexpr size_t kMaxExpertsPerMessage = 65536;     // expert lists, hints, resident sets
inline constexpr size_t kMaxExpertUsageEntries = 1 << 20;  // n_moe_layers * n_experts
inline constexpr size_t kMaxReleaseSequences = 65536;
inline constexpr size_t kMaxEosIds = 64;
inline constexpr size_t kMaxStringBytes = 4096;  // names, messages, details
// FlatBuffers verifier bounds: our tables nest at most 4 deep.
inline constexpr uint32_t kVerifierMaxDepth = 16;
inline constexpr uint32_t kVerifierMaxTables = 3 * kMaxStepSequences + 64;

// ------------------------------------------------------------------- hello

enum class Role : uint8_t { gateway = 0, worker = 1 };

struct ExpertLayout {
  uint32_t n_layers = 0;
  uint32_t n_moe_layers = 0;
  uint32_t n_experts = 0;  // routed experts per MoE layer
  uint32_t top_k = 0;
  uint64_t expert_blob_bytes = 0;    // one expert's weights in an island
  std::vector<uint16_t> moe_layers;  // [n_moe_layers]: model layer index of each MoE layer
  bool operator==(const ExpertLayout&) const = default;
};

// Sent by the gateway on connect (role gateway; capacity fields zero) and
// answered by the worker with its own (same request id).
struct Hello {
  uint32_t protocol_version = kProtocolVersion;
  Role role = Role::gateway;
  std::string model_id;
  std::string backend;   // "cpu" | "cuda"; empty from a gateway
  std::string instance;  // sender's name, for logs
  uint32_t kv_blocks_total = 0;
  uint32_t kv_block_tokens = 0;  // tokens per KV block
  uint32_t max_context = 0;      // tokens per sequence, prompt + generated
  uint64_t vram_budget_bytes = 0;
  uint32_t islands_total = 0;
  uint32_t max_batch_sequences = 0;
  uint32_t max_step_tokens = 0;
  ExpertLayout experts;
  uint32_t vocab_size = 0;
  std::vector<int32_t> eos_ids;
  bool operator==(const Hello&) const = default;
};

// ok, or version_mismatch's message. Call on the peer's hello.
[[nodiscard]] Status check_version(const Hello& peer);

// ----------------------------------------------------------------- experts

struct LoadExpert {
  uint16_t layer = 0;
  std::vector<uint16_t> experts;
  bool pin = false;  // keep resident until unloaded
  bool operator==(const LoadExpert&) const = default;
};

struct LoadExpertReply {
  uint16_t layer = 0;
  std::vector<uint16_t> resident;  // resident now (already or newly)
  std::vector<uint16_t> failed;
  uint64_t bytes_copied = 0;
  uint32_t elapsed_us = 0;
  std::string message;
  bool operator==(const LoadExpertReply&) const = default;
};

struct UnloadExpert {
  uint16_t layer = 0;
  std::vector<uint16_t> experts;
  bool operator==(const UnloadExpert&) const = default;
};

struct UnloadExpertReply {
  uint16_t layer = 0;
  std::vector<uint16_t> unloaded;
  std::vector<uint16_t> failed;  // e.g. in use by a running step
  std::string message;
  bool operator==(const UnloadExpertReply&) const = default;
};

struct ExpertRef {
  uint16_t layer = 0;
  uint16_t expert = 0;
  bool operator==(const ExpertRef&) const = default;
};

struct ExpertHint {
  uint16_t layer = 0;
  uint16_t expert = 0;
  float priority = 0.0f;  // higher first; [0, 1] by convention
  bool operator==(const ExpertHint&) const = default;
};

struct WarmHints {
  std::vector<ExpertHint> hints;
  uint64_t seq_id = 0;   // sequence they were predicted for; 0: none
  bool replace = false;  // drop earlier hints first
  bool operator==(const WarmHints&) const = default;
};

// -------------------------------------------------------------------- step

struct SamplingParams {
  float temperature = 1.0f;  // 0: greedy
  float top_p = 1.0f;        // (0, 1]
  uint32_t top_k = 0;        // 0: off
  uint64_t seed = 0;
  bool logprobs = false;     // report the sampled token's logprob
  uint8_t top_logprobs = 0;  // alternatives to report, 0..kMaxTopLogprobs
  // Version 2 (docs/sampling.md). adjust: sorted by token, distinct.
  float repetition_penalty = 1.0f;  // finite, > 0
  float presence_penalty = 0.0f;
  float frequency_penalty = 0.0f;
  float min_p = 0.0f;               // [0, 1]
  std::vector<TokenAdjust> adjust;
  // Bit t % 32 of word t / 32: token t may be drawn; empty: all
  // (docs/structured-output.md). The worker checks the size against its vocabulary.
  std::vector<uint32_t> allowed;
  bool operator==(const SamplingParams&) const = default;
};

// What is wrong with a sequence's sampling parameters as the worker takes
// them (docs/sampling.md), or empty. The worker refuses a step holding such
// a sequence; the gateway checks each sequence with the same rule before it
// sends one, so a bad sequence ends alone instead of failing its step.
std::string sampling_problem(const SamplingParams& o);
// sampling_problem's answer for a mask of allowed tokens that names none
// (a structured value no token can continue).
inline constexpr const char* kNoAllowedToken = "allowed names no token";

struct StepSequence {
  uint64_t seq_id = 0;
  std::vector<int32_t> tokens;  // new tokens of this chunk, at least one
  uint32_t start_pos = 0;       // position of tokens[0]; 0: a fresh sequence
  bool sample = true;           // false: a non-final prefill chunk, nothing sampled
  SamplingParams sampling;
  uint64_t route_bucket = 0;    // the gateway's routing-class tag, copied into routing summaries; 0: none
  bool operator==(const StepSequence&) const = default;
};

struct StepRequest {
  std::vector<StepSequence> sequences;  // distinct seq ids
  bool report_expert_usage = true;
  bool operator==(const StepRequest&) const = default;
};

struct TokenLogprob {
  int32_t token = 0;
  float logprob = 0.0f;  // natural log
  bool operator==(const TokenLogprob&) const = default;
};

struct StepResult {
  uint64_t seq_id = 0;
  ErrorCode error = ErrorCode::none;  // none: the fields below are valid
  std::string error_message;
  bool sampled = false;
  int32_t token = 0;
  float logprob = 0.0f;
  std::vector<TokenLogprob> top;       // [top_logprobs], best first
  std::vector<uint16_t> expert_usage;  // [n_moe_layers * n_experts]: tokens each expert served
  uint32_t kv_tokens = 0;              // tokens the worker now holds for the sequence
  uint32_t cached_tokens = 0;          // of a fresh prompt, the tokens whose KV came from the prefix cache
  bool operator==(const StepResult&) const = default;
};

struct StepTiming {
  uint32_t total_us = 0;
  uint32_t queue_us = 0;
  uint32_t compute_us = 0;
  uint32_t expert_wait_us = 0;
  bool operator==(const StepTiming&) const = default;
};

struct StepReply {
  std::vector<StepResult> results;  // one per request sequence, same order
  StepTiming timing;
  uint32_t kv_blocks_used = 0;
  uint32_t kv_blocks_free = 0;
  uint32_t expert_hits = 0;
  uint32_t expert_misses = 0;
  bool operator==(const StepReply&) const = default;
};

// ------------------------------------------------------------ housekeeping

struct ReleaseSequences {
  std::vector<uint64_t> seq_ids;
  bool operator==(const ReleaseSequences&) const = default;
};

struct StatsRequest {
  bool include_resident = false;
  bool operator==(const StatsRequest&) const = default;
};

// NVML's throttle-reason bits (nvmlClocksThrottleReason*), as CardHealth carries them.
namespace throttle {
constexpr uint64_t gpu_idle = 0x1, applications_clocks = 0x2, sw_power_cap = 0x4, hw_slowdown = 0x8,
                   sync_boost = 0x10, sw_thermal = 0x20, hw_thermal = 0x40, hw_power_brake = 0x80,
                   display_clocks = 0x100;
// Each bit with its name, as /metrics and the logs spell it.
struct Reason {
  uint64_t bit;
  const char* name;
};
inline constexpr Reason kReasons[] = {{gpu_idle, "gpu_idle"},         {applications_clocks, "applications_clocks"},
                                      {sw_power_cap, "sw_power_cap"}, {hw_slowdown, "hw_slowdown"},
                                      {sync_boost, "sync_boost"},     {sw_thermal, "sw_thermal"},
                                      {hw_thermal, "hw_thermal"},     {hw_power_brake, "hw_power_brake"},
                                      {display_clocks, "display_clocks"}};
}  // namespace throttle

struct CardHealth {
  bool available = false;
  std::string reason;  // why not available
  std::string name;
  int32_t temperature_c = 0;
  uint32_t sm_clock_mhz = 0;
  uint32_t sm_clock_max_mhz = 0;
  uint32_t memory_clock_mhz = 0;
  uint32_t power_mw = 0;
  uint32_t power_limit_mw = 0;
  uint64_t throttle_reasons = 0;
  uint64_t process_memory_bytes = 0;
  uint64_t memory_total_bytes = 0;
  uint32_t pcie_tx_kbps = 0;
  uint32_t pcie_rx_kbps = 0;
  uint32_t sample_age_ms = 0;
  uint64_t sample_seq = 0;  // counts samples: the same number is the same sample
  bool operator==(const CardHealth&) const = default;
};

struct StatsReply {
  uint64_t expert_hits = 0;
  uint64_t expert_misses = 0;
  uint64_t bytes_copied = 0;
  uint32_t islands_used = 0;
  uint32_t islands_total = 0;
  uint32_t kv_blocks_used = 0;
  uint32_t kv_blocks_free = 0;
  uint64_t steps = 0;
  uint64_t tokens = 0;  // all tokens run through the model
  uint64_t sampled_tokens = 0;
  uint32_t sequences_active = 0;
  uint64_t uptime_ms = 0;
  std::vector<ExpertRef> resident;  // when include_resident was asked
  uint64_t bytes_streamed = 0;      // expert bytes the kernels read from host memory
  CardHealth card;
  bool operator==(const StatsReply&) const = default;
};

enum class ShutdownMode : uint8_t {
  drain = 0,      // answer the steps already received, then close
  immediate = 1,  // close now
};

struct Shutdown {
  ShutdownMode mode = ShutdownMode::drain;
  std::string reason;
  bool operator==(const Shutdown&) const = default;
};

struct Ping {
  uint64_t sent_us = 0;
  bool operator==(const Ping&) const = default;
};

struct Pong {
  uint64_t ping_sent_us = 0;  // echoed
  uint64_t sent_us = 0;
  bool operator==(const Pong&) const = default;
};

enum class PressureLevel : uint8_t {
  warn = 0,    // stop admitting
  evict = 1,   // worker drops cold experts; shrink batches
  break_ = 2,  // worker exits cleanly soon; fail over now
};

struct Pressure {
  PressureLevel level = PressureLevel::warn;
  std::string detail;
  uint64_t vram_free_bytes = 0;
  uint64_t host_free_bytes = 0;
  bool operator==(const Pressure&) const = default;
};

struct ErrorReport {
  ErrorCode code = ErrorCode::internal;
  uint8_t command = 0;      // command byte of the frame this answers
  uint64_t request_id = 0;  // request id of the frame this answers (0: none)
  std::string message;
  bool operator==(const ErrorReport&) const = default;
};

const char* pressure_level_name(PressureLevel level);

// ------------------------------------------------------------ payload codecs

std::vector<uint8_t> encode_hello(const Hello& m);
std::vector<uint8_t> encode_load_expert(const LoadExpert& m);
std::vector<uint8_t> encode_load_expert_reply(const LoadExpertReply& m);
std::vector<uint8_t> encode_unload_expert(const UnloadExpert& m);
std::vector<uint8_t> encode_unload_expert_reply(const UnloadExpertReply& m);
std::vector<uint8_t> encode_warm_hints(const WarmHints& m);
std::vector<uint8_t> encode_step(const StepRequest& m);
std::vector<uint8_t> encode_step_reply(const StepReply& m);
std::vector<uint8_t> encode_release_sequences(const ReleaseSequences& m);
std::vector<uint8_t> encode_stats_request(const StatsRequest& m);
std::vector<uint8_t> encode_stats_reply(const StatsReply& m);
std::vector<uint8_t> encode_shutdown(const Shutdown& m);
std::vector<uint8_t> encode_ping(const Ping& m);
std::vector<uint8_t> encode_pong(const Pong& m);
std::vector<uint8_t> encode_pressure(const Pressure& m);
std::vector<uint8_t> encode_error(const ErrorReport& m);

using Payload = std::span<const uint8_t>;
[[nodiscard]] Result<Hello> decode_hello(Payload p);
[[nodiscard]] Result<LoadExpert> decode_load_expert(Payload p);
[[nodiscard]] Result<LoadExpertReply> decode_load_expert_reply(Payload p);
[[nodiscard]] Result<UnloadExpert> decode_unload_expert(Payload p);
[[nodiscard]] Result<UnloadExpertReply> decode_unload_expert_reply(Payload p);
[[nodiscard]] Result<WarmHints> decode_warm_hints(Payload p);
[[nodiscard]] Result<StepRequest> decode_step(Payload p);
[[nodiscard]] Result<StepReply> decode_step_reply(Payload p);
[[nodiscard]] Result<ReleaseSequences> decode_release_sequences(Payload p);
[[nodiscard]] Result<StatsRequest> decode_stats_request(Payload p);
[[nodiscard]] Result<StatsReply> decode_stats_reply(Payload p);
[[nodiscard]] Result<Shutdown> decode_shutdown(Payload p);
[[nodiscard]] Result<Ping> decode_ping(Payload p);
[[nodiscard]] Result<Pong> decode_pong(Payload p);
[[nodiscard]] Result<Pressure> decode_pressure(Payload p);
[[nodiscard]] Result<ErrorReport> decode_error(Payload p);

// -------------------------------------------------------------- whole frames

// Any message, tagged by type; each type belongs to exactly one command.
using Message = std::variant<Hello, LoadExpert, LoadExpertReply, UnloadExpert, UnloadExpertReply,
                             WarmHints, StepRequest, StepReply, ReleaseSequences, StatsRequest,
                             StatsReply, Shutdown, Ping, Pong, Pressure, ErrorReport>;

// The command byte that carries `m`.
Command command_of(const Message& m);

// Decodes the payload of any known command. A failure is recoverable: reply
// with make_error_frame(frame.request_id, frame.command, malformed_payload, ...).
[[nodiscard]] Result<Message> decode_message(const Frame& frame);

// A whole frame (header + payload). Fails only when the frame would exceed
// `max_frame_bytes` (the peer would drop the connection over it).
[[nodiscard]] Result<std::vector<uint8_t>> make_frame(uint64_t request_id, const Hello& m,
                                                      size_t max_frame_bytes = kMaxFrameBytes);
[[nodiscard]] Result<std::vector<uint8_t>> make_frame(uint64_t request_id, const LoadExpert& m,
                                                      size_t max_frame_bytes = kMaxFrameBytes);
[[nodiscard]] Result<std::vector<uint8_t>> make_frame(uint64_t request_id, const LoadExpertReply& m,
                                                      size_t max_frame_bytes = kMaxFrameBytes);
[[nodiscard]] Result<std::vector<uint8_t>> make_frame(uint64_t request_id, const UnloadExpert& m,
                                                      size_t max_frame_bytes = kMaxFrameBytes);
[[nodiscard]] Result<std::vector<uint8_t>> make_frame(uint64_t request_id,
                                                      const UnloadExpertReply& m,
                                                      size_t max_frame_bytes = kMaxFrameBytes);
[[nodiscard]] Result<std::vector<uint8_t>> make_frame(uint64_t request_id, const WarmHints& m,
                                                      size_t max_frame_bytes = kMaxFrameBytes);
[[nodiscard]] Result<std::vector<uint8_t>> make_frame(uint64_t request_id, const StepRequest& m,
                                                      size_t max_frame_bytes = kMaxFrameBytes);
[[nodiscard]] Result<std::vector<uint8_t>> make_frame(uint64_t request_id, const StepReply& m,
                                                      size_t max_frame_bytes = kMaxFrameBytes);
[[nodiscard]] Result<std::vector<uint8_t>> make_frame(uint64_t request_id,
                                                      const ReleaseSequences& m,
                                                      size_t max_frame_bytes = kMaxFrameBytes);
[[nodiscard]] Result<std::vector<uint8_t>> make_frame(uint64_t request_id, const StatsRequest& m,
                                                      size_t max_frame_bytes = kMaxFrameBytes);
[[nodiscard]] Result<std::vector<uint8_t>> make_frame(uint64_t request_id, const StatsReply& m,
                                                      size_t max_frame_bytes = kMaxFrameBytes);
[[nodiscard]] Result<std::vector<uint8_t>> make_frame(uint64_t request_id, const Shutdown& m,
                                                      size_t max_frame_bytes = kMaxFrameBytes);
[[nodiscard]] Result<std::vector<uint8_t>> make_frame(uint64_t request_id, const Ping& m,
                                                      size_t max_frame_bytes = kMaxFrameBytes);
[[nodiscard]] Result<std::vector<uint8_t>> make_frame(uint64_t request_id, const Pong& m,
                                                      size_t max_frame_bytes = kMaxFrameBytes);
[[nodiscard]] Result<std::vector<uint8_t>> make_frame(uint64_t request_id, const Pressure& m,
                                                      size_t max_frame_bytes = kMaxFrameBytes);
[[nodiscard]] Result<std::vector<uint8_t>> make_frame(uint64_t request_id, const ErrorReport& m,
                                                      size_t max_frame_bytes = kMaxFrameBytes);

// Any message: the typed overload for the alternative it holds.
[[nodiscard]] Result<std::vector<uint8_t>> make_frame(uint64_t request_id, const Message& m,
                                                      size_t max_frame_bytes = kMaxFrameBytes);

// The error frame answering frame (`request_id`, `command`); the message is
// cut to kMaxStringBytes. Cannot fail.
std::vector<uint8_t> make_error_frame(uint64_t request_id, uint8_t command, ErrorCode code,
                                      std::string_view message);
// The error frame answering a FrameError from the decoder.
std::vector<uint8_t> make_error_frame(const FrameError& err);

}  // namespace moe::protocol
