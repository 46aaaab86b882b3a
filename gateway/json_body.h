#pragma once
// JSON in and out of the gateway, with nothing left to throw.
//
// In: every JSON text that comes from outside (a request body, a stored
// session read back from Redis) is parsed by parse_json_body, which refuses
// nesting deeper than a small bound before the parser sees it (the tree is
// later copied, walked and dumped recursively, so depth is stack), and turns
// every way the parser can fail (syntax, invalid UTF-8, a number outside the
// double range such as 1e400) into an ApiError instead of an exception.
//
// Out: json_text dumps with invalid UTF-8 replaced by U+FFFD, so that bytes
// from a token, a worker or Redis can never make a dump throw.

#include <string>
#include <string_view>
#include <variant>

#include <nlohmann/json.hpp>

#include "gateway/api_error.h"

namespace moe::gw {

// Arrays and objects nested deeper than this are refused (a chat request
// needs 4: body, messages, a message, its content parts).
inline constexpr int kMaxJsonDepth = 32;

// The deepest nesting of arrays and objects in `text`, counting brackets
// outside strings; it stops counting (and returns) once past `stop_after`.
int json_nesting_depth(std::string_view text, int stop_after = kMaxJsonDepth);

using ParsedJson = std::variant<nlohmann::json, ApiError>;

// A 400 invalid_json / invalid_utf8 / nesting_too_deep error, or the value.
ParsedJson parse_json_body(std::string_view text, int max_depth = kMaxJsonDepth);

// The JSON text of `j`, invalid UTF-8 replaced.
std::string json_text(const nlohmann::json& j);

}  // namespace moe::gw
