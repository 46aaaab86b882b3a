#pragma once
// What this server does with each parameter of OpenAI's completions and
// chat completions APIs, and of the sampling extensions other servers
// accept (vLLM's names): a parameter we do not honour is refused with 400
// `unsupported_parameter` naming it whenever its value asks for something,
// and passes when its value asks for nothing (its default: a zero penalty,
// an empty list, `response_format` text, ...). A client asking for JSON
// mode, tools or a penalty thus never gets 200 and something else. Keys
// that no API names pass, as vLLM lets them. docs/gateway.md lists the
// table.

#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "gateway/api/completion_request.h"
#include "gateway/api_error.h"

namespace moe::gw {

// The refusal for the first parameter of `body` (a request to `kind`'s
// endpoint) that asks for something this server does not do, or nullopt.
std::optional<ApiError> refuse_unsupported(ApiKind kind, const nlohmann::json& body);

// The table, for docs and tests: name, the endpoints it belongs to
// ("chat", "completions" or "both"), and the values accepted (what a
// client may send that asks for nothing).
struct UnsupportedParameter {
  const char* name;
  const char* apis;
  const char* accepted;
};
const std::vector<UnsupportedParameter>& unsupported_parameters();

}  // namespace moe::gw
