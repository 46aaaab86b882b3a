#include "gateway/json_body.h"

namespace moe::gw {

using json = nlohmann::json;

int json_nesting_depth(std::string_view text, int stop_after) {
  int depth = 0, deepest = 0;
  bool in_string = false, escaped = false;
  for (char c : text) {
    if (in_string) {
      if (escaped) {
        escaped = false;
      } else if (c == '\\') {
        escaped = true;
      } else if (c == '"') {
        in_string = false;
      }
      continue;
    }
    switch (c) {
      case '"':
        in_string = true;
        break;
      case '[':
      case '{':
        if (++depth > deepest) {
          deepest = depth;
          if (deepest > stop_after) return deepest;
        }
        break;
      case ']':
      case '}':
        if (depth > 0) --depth;
        break;
      default:
        break;
    }
  }
  return deepest;
}

ParsedJson parse_json_body(std::string_view text, int max_depth) {
  if (json_nesting_depth(text, max_depth) > max_depth) {
    return ApiError{400, "The request body nests arrays or objects deeper than " + std::to_string(max_depth) + " levels.",
                    "invalid_request_error", "", "nesting_too_deep"};
  }
  try {
    return json::parse(text);
  } catch (const json::parse_error& e) {
    const std::string what = e.what();
    if (what.find("UTF-8") != std::string::npos || what.find("surrogate") != std::string::npos) {
      return ApiError{400, "The request body contains invalid UTF-8.", "invalid_request_error", "", "invalid_utf8"};
    }
    return ApiError{400, "The request body is not valid JSON: " + what, "invalid_request_error", "", "invalid_json"};
  } catch (const json::out_of_range&) {
    // 1e400, -1e999, a 400-digit integer: past what a double holds.
    return ApiError{400, "The request body holds a number outside the range of a double.", "invalid_request_error", "",
                    "invalid_json"};
  } catch (const json::exception& e) {
    return ApiError{400, std::string("The request body is not valid JSON: ") + e.what(), "invalid_request_error", "",
                    "invalid_json"};
  }
}

std::string json_text(const json& j) { return j.dump(-1, ' ', false, json::error_handler_t::replace); }

}  // namespace moe::gw
