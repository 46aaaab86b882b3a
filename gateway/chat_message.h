#pragma once
// One chat turn as the gateway keeps it: a role the API accepts and the
// turn's text. Built only from validated request fields (or validated
// stored turns), so that nothing else a client sent travels with it.

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace moe::gw {

struct ChatMessage {
  ChatMessage() = default;
  ChatMessage(std::string r, std::string c, std::string calls = {}, std::string call_id = {})
      : role(std::move(r)), content(std::move(c)), tool_calls(std::move(calls)), tool_call_id(std::move(call_id)) {}
  bool operator==(const ChatMessage&) const = default;

  std::string role;     // system, user, assistant or tool ("developer" arrives as system)
  std::string content;  // the text (content parts joined)
  // An assistant turn's tool calls, as validated compact JSON
  // ([{"id", "type": "function", "function": {"name", "arguments"}}]); "" none.
  std::string tool_calls;
  std::string tool_call_id;  // a tool turn: the call it answers ("" none)
  // A stored assistant turn: the Idempotency-Key of the request it answered
  // ("" none), a digest of that request's new turns, and how it finished,
  // so that a retried turn is answered from the store, not run and stored
  // twice (docs/scale-out.md).
  std::string request_key;
  std::string request_digest;
  std::string finish_reason;
  // And the response that carried it, which a retry gets again unchanged:
  // its id, its "created" (unix seconds) and its usage (compact JSON, "" none).
  std::string response_id;
  int64_t created = 0;
  std::string usage;
};

using ChatMessages = std::vector<ChatMessage>;

}  // namespace moe::gw
