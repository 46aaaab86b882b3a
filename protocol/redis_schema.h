#pragma once
// What the gateway and the worker keep in Redis, defined once: the keys, the
// streams' field names and values, the consumer group, and the text formats
// of the expert lists and routing summaries (docs/state-and-failover.md).
// Both processes build and read every key and entry through this header, so
// the two sides cannot drift apart; what it writes is what earlier releases
// wrote, byte for byte, so state already in Redis stays readable.
//
//   moe:<model>:resident   stream, worker → gateways
//                          worker=<name> kind=snapshot|change experts=<list>
//   moe:<model>:routing    stream, worker → gateways
//                          worker=<name> seq=<id> layers=<routing> [bucket=<tag>]
//   moe:<model>:events     stream, gateways → workers (consumer group "workers")
//                          type=warm experts=<list>
//                          type=session session=<digest> messages=<count>
//   moe:session:<owner>:<id>  string, gateways only: the conversation as JSON
//
// <list> is an expert list, "3:17 3:20 5:1": layer:expert pairs (the model's
// layer index), one space between pairs. <routing> is a routing summary,
// "0:3=5,7=2 1:4=1": per MoE layer (its index among the MoE layers), the
// tokens each expert served. Every stream is appended with MAXLEN ~ so that
// it stays bounded.

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "model/result.h"
#include "protocol/messages.h"

namespace moe::protocol {

// ------------------------------------------------------------------- keys

// The model's name inside the keys: the last part of the model's path (a
// folder or a packed file), trailing slashes ignored: "models/demo-moe/" →
// "demo-moe".
std::string redis_model_name(std::string_view model_path);

std::string resident_stream_key(std::string_view model);  // moe:<model>:resident
std::string routing_stream_key(std::string_view model);   // moe:<model>:routing
std::string events_stream_key(std::string_view model);    // moe:<model>:events

// The workers' consumer group on the events stream.
inline constexpr std::string_view kEventsGroup = "workers";

// A session's key. `owner` is session_owner_of_key() for a caller with an
// API key, kSessionOwnerOpen for the server-issued ids of a keyless gateway.
std::string session_key(std::string_view owner, std::string_view id);
inline constexpr std::string_view kSessionOwnerOpen = "open";
// The owner of a key-holding caller's sessions, from a digest of the key
// (hex; the gateway chooses the digest).
std::string session_owner_of_key(std::string_view key_digest);

// Entries kept per stream (XADD … MAXLEN ~ this), unless configured otherwise.
inline constexpr uint64_t kStreamMaxLen = 10000;

// ---------------------------------------------------------- stream entries

// A stream entry's fields as Redis holds them: name, value, name, value, …
using StreamFields = std::vector<std::string>;

// Field names.
namespace stream_field {
// resident, routing: the worker's name (its socket's name)
inline constexpr std::string_view kWorker = "worker";
// resident: kResidentSnapshot or kResidentChange
inline constexpr std::string_view kKind = "kind";
// resident, warm events: an expert list
inline constexpr std::string_view kExperts = "experts";
// routing: the sequence id
inline constexpr std::string_view kSeq = "seq";
// routing: the routing summary
inline constexpr std::string_view kLayers = "layers";
// routing: the gateway's route_bucket, when the steps carried a non-zero one
inline constexpr std::string_view kBucket = "bucket";
// events: kEventWarm or kEventSession
inline constexpr std::string_view kType = "type";
// session events: a digest of the session's key
inline constexpr std::string_view kSession = "session";
// session events: the turns stored
inline constexpr std::string_view kMessages = "messages";
}  // namespace stream_field

// Values of `kind` in the resident stream: the set a worker holds on start
// (and after it reconnected), and the set after a change.
inline constexpr std::string_view kResidentSnapshot = "snapshot";
inline constexpr std::string_view kResidentChange = "change";
// Values of `type` in the events stream.
inline constexpr std::string_view kEventWarm = "warm";
inline constexpr std::string_view kEventSession = "session";

// The entries, their fields in the order they go on the wire.
StreamFields resident_entry(std::string_view worker, std::string_view kind,
                            std::string_view experts);
// `bucket` 0: the field is left out (the steps carried no route_bucket).
StreamFields routing_entry(std::string_view worker, uint64_t seq, std::string_view layers,
                           uint64_t bucket);
StreamFields warm_event(std::string_view experts);
StreamFields session_event(std::string_view session_digest, size_t messages);

// The command that appends `fields` to `stream`, trimmed to about `max_len`
// entries: XADD <stream> MAXLEN ~ <max_len> * <fields…>.
std::vector<std::string> stream_append_command(std::string_view stream, uint64_t max_len,
                                               const StreamFields& fields);

// The value of the field `name` in an entry read back; nullptr when the
// entry has none (the first one wins when a name repeats).
const std::string* find_field(const StreamFields& fields, std::string_view name);

// ------------------------------------------------------------ expert lists

// A text longer than this is refused unread: 65,536 pairs of the largest
// numbers, with their spaces, take less.
inline constexpr size_t kMaxExpertListBytes = size_t(1) << 20;

// [(3,17), (3,20), (5,1)] → "3:17 3:20 5:1"; an empty list is empty text.
std::string format_expert_list(std::span<const ExpertRef> experts);
// The reverse. Each pair is two decimal numbers (digits only, each at most
// 65535) around one ':'; pairs are separated by spaces (extra spaces are
// ignored). Empty text is an empty list. Anything else, more than
// kMaxExpertsPerMessage pairs, or more than kMaxExpertListBytes of text is
// an error that quotes (at most 40 bytes of) the offending pair.
Result<std::vector<ExpertRef>> parse_expert_list(std::string_view text);

// -------------------------------------------------------- routing summaries

// Tokens each expert served, [moe_layer * n_experts + expert] (a partial
// last layer is allowed) → "0:3=5,7=2 1:4=1": experts that served nothing
// and layers where none did are left out; nothing used is empty text.
std::string format_routing_layers(std::span<const uint32_t> usage, uint32_t n_experts);
// The reverse, for a model of `n_layers` MoE layers of `n_experts` experts:
// tokens per [layer * n_experts + expert] (a layer or expert named twice adds
// up; empty layers and a trailing ',' are tolerated). A layer or expert out of
// range, or a part that is not layer:expert=tokens,… in digits, is an error
// that quotes (at most 40 bytes of) the offending part.
Result<std::vector<float>> parse_routing_layers(std::string_view text, int n_layers, int n_experts);

}  // namespace moe::protocol
