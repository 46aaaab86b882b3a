#pragma once
// The body of POST /v1/chat/completions and POST /v1/completions, parsed and
// validated into what the gateway submits: token-id prompts, sampling,
// stop strings, choice count, streaming options. Every refusal is an
// ApiError naming the offending parameter, in OpenAI's words where they exist.

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include <nlohmann/json.hpp>

#include "gateway/api_error.h"
#include "gateway/chat_message.h"
#include "gateway/sched/scheduler.h"
#include "gateway/api/text_codec.h"
#include "gateway/structured/json_schema.h"

namespace moe::gw {

enum class ApiKind { chat, completion };

struct CompletionRequest {
  ApiKind kind = ApiKind::chat;
  std::string model;
  std::vector<std::vector<int32_t>> prompts;  // choices = prompts.size() × n
  int max_new_tokens = 0;                     // per choice, resolved against the context
  bool max_tokens_given = false;
  Sampling sampling;  // seed: of choice 0; choice i samples with seed + i
  bool seed_given = false;
  std::vector<std::string> stop;  // at most 4, non-empty
  // Token ids that end a choice besides the model's own (`stop_token_ids`),
  // and `ignore_eos`: the model's EOS / end-of-turn ids do not end it.
  std::vector<int32_t> stop_token_ids;
  bool ignore_eos = false;
  // Token controls (docs/sampling.md; penalties and min_p are in `sampling`):
  // logit_bias by token id, sorted; min_tokens before a stop id or string may end a choice.
  std::vector<std::pair<int32_t, float>> logit_bias;
  int min_tokens = 0;
  // response_format json_object / json_schema (docs/structured-output.md): the
  // schema every choice's text must follow; null: free text.
  std::shared_ptr<const structured::Schema> response_schema;
  // Tools (chat; docs/gateway.md, "Tools"): the functions the template
  // describes, and what the answer may do with them. required / named are
  // enforced by the grammar `response_schema` then holds.
  nlohmann::json tools = nlohmann::json::array();
  enum class ToolChoice { none, automatic, required, named };
  ToolChoice tool_choice = ToolChoice::none;
  std::string tool_name;  // ToolChoice::named
  bool parallel_tool_calls = true;
  int n = 1;
  // Completions: best_of candidates a prompt, of which the n with the highest
  // log probability per token are returned (0: n); echo: the prompt's text
  // before each choice's.
  int best_of = 0;
  bool echo = false;
  bool stream = false;
  bool include_usage = false;
  std::string user;
  // Chat: this request's messages, validated (what a session stores).
  ChatMessages messages;
  // What the context policy left out of the prompt (docs/gateway.md,
  // "Context policy"): the oldest turns of a chat that would overflow the
  // context, or the head cut by truncate_prompt_tokens.
  int trimmed_messages = 0;
  int64_t trimmed_tokens = 0;
};

struct RequestLimits {
  std::string served_model_name;
  int max_context = 0;          // tokens; 0: unknown, not checked
  // Tokens the largest serving worker's KV cache holds (0: unknown): a
  // longer prompt is refused, a chat's history trimmed to it.
  int kv_capacity = 0;
  int max_choices = 128;        // prompts × n
  // What one request may cost: choices × max_new_tokens (the generated
  // tokens it may ask for), and for a whole (not streamed) response with
  // logprobs, choices × max_new_tokens × (1 + top_logprobs) entries held
  // until the end. Past either: 400 request_too_costly.
  int64_t max_request_tokens = int64_t(1) << 20;
  int64_t max_logprob_entries = int64_t(1) << 18;
};

using ParsedRequest = std::variant<CompletionRequest, ApiError>;

// `body` is the request's JSON (parse_json_body). `prior`: a chat session's
// stored turns, rendered before the request's messages.
ParsedRequest parse_completion_request(ApiKind kind, const nlohmann::json& body, const TextCodec& codec,
                                       const RequestLimits& limits, const ChatMessages& prior = {});
// The same from the body's text.
ParsedRequest parse_completion_request(ApiKind kind, std::string_view body, const TextCodec& codec,
                                       const RequestLimits& limits, const ChatMessages& prior = {});

// The `messages` of a chat body, validated (role, text content or text
// parts): all of a client's turns that the template or a session ever sees.
std::optional<ApiError> parse_chat_messages(const nlohmann::json& body, ChatMessages* out);
// Stored turns then new ones, as the chat template takes them.
nlohmann::json template_messages(const ChatMessages& prior, const ChatMessages& messages);
// `chat_template_kwargs`: more variables for the chat template (e.g.
// enable_thinking), none of the names the server itself gives it; {} when absent.
std::optional<ApiError> parse_template_kwargs(const nlohmann::json& body, nlohmann::json* out);

}  // namespace moe::gw
