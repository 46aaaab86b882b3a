#include "gateway/api_error.h"

#include <nlohmann/json.hpp>

namespace moe::gw {

std::string api_error_json(const ApiError& e) {
  using json = nlohmann::json;
  json err = {{"message", e.message},
              {"type", e.type},
              {"param", e.param.empty() ? json(nullptr) : json(e.param)},
              {"code", e.code.empty() ? json(nullptr) : json(e.code)}};
  return json{{"error", err}}.dump(-1, ' ', false, json::error_handler_t::replace);
}

HttpResponse api_error_response(const ApiError& e) {
  HttpResponse r;
  r.status = e.status;
  r.headers = {{"Content-Type", "application/json"}};
  r.body = api_error_json(e);
  return r;
}

}  // namespace moe::gw
