#pragma once
// Errors in OpenAI's shape:
//   {"error": {"message": …, "type": …, "param": … | null, "code": … | null}}

#include <string>

#include "gateway/http/http_server.h"

namespace moe::gw {

struct ApiError {
  int status = 400;
  std::string message;
  std::string type = "invalid_request_error";
  std::string param;  // "" → null
  std::string code;   // "" → null
};

inline ApiError invalid_param(std::string param, std::string message, std::string code = "") {
  return ApiError{400, std::move(message), "invalid_request_error", std::move(param), std::move(code)};
}

// The JSON text of the error object.
std::string api_error_json(const ApiError& e);
// A complete response: status, JSON body, content type.
HttpResponse api_error_response(const ApiError& e);

}  // namespace moe::gw
