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

#include "gateway/api_error.h"
#include "gateway/scheduler.h"
#include "gateway/text_codec.h"

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
  int n = 1;
  bool stream = false;
  bool include_usage = false;
  std::string user;
};

struct RequestLimits {
  std::string served_model_name;
  int max_context = 0;          // tokens; 0: unknown, not checked
  int max_choices = 128;        // prompts × n
};

using ParsedRequest = std::variant<CompletionRequest, ApiError>;

ParsedRequest parse_completion_request(ApiKind kind, std::string_view body, const TextCodec& codec,
                                       const RequestLimits& limits);

}  // namespace moe::gw
