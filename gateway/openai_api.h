#pragma once
// The OpenAI-compatible HTTP API over a Scheduler: routing, authentication,
// the endpoints, and OpenAI-shaped errors.
//
//   POST /v1/chat/completions   POST /v1/completions   (stream: SSE)
//   GET  /v1/models             GET  /v1/models/{id}
//   GET  /health (no auth)      GET  /metrics (Prometheus text)
//   POST /debug/experts         (the expert prediction for a prompt; 404 while --predict off)
//
// Threading: loop thread only.

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <random>
#include <string>

#include <nlohmann/json.hpp>

#include "gateway/completion_request.h"
#include "gateway/expert_prediction.h"
#include "gateway/http_server.h"
#include "gateway/metrics.h"
#include "gateway/scheduler.h"
#include "gateway/session_store.h"
#include "gateway/text_codec.h"

namespace moe::gw {

struct ApiOptions {
  std::string served_model_name = "demo-moe";
  std::string api_key;    // "": no authentication
  int max_choices = 128;  // prompts × n per request
  SessionStore* sessions = nullptr;  // chat sessions by `session_id` / X-Session-Id (null: off)
  const PromptExpertPredictor* predictor = nullptr;  // /debug/experts (null: 404)
  // Worker name → its published resident set, for /debug/experts (may be unset).
  std::function<std::map<std::string, std::string>()> resident_sets;
};

class OpenAiApi final : public HttpHandler {
 public:
  // All pointers must outlive the API object.
  OpenAiApi(ApiOptions opts, Scheduler* scheduler, const TextCodec* codec, GatewayMetrics* metrics);

  void handle(const std::shared_ptr<HttpExchange>& ex) override;
  HttpResponse protocol_error(int status, const std::string& message) override;

 private:
  void completions(ApiKind kind, const std::shared_ptr<HttpExchange>& ex);
  // After the session's stored messages (if any) were loaded.
  void run_completion(ApiKind kind, const std::shared_ptr<HttpExchange>& ex, const std::string& session_id,
                      nlohmann::json prior);
  void models(const std::shared_ptr<HttpExchange>& ex, const std::string& path);
  void health(const std::shared_ptr<HttpExchange>& ex);
  void metrics(const std::shared_ptr<HttpExchange>& ex);
  void debug_experts(const std::shared_ptr<HttpExchange>& ex);
  void reply(const std::shared_ptr<HttpExchange>& ex, const std::string& endpoint, HttpResponse r);
  void reply_error(const std::shared_ptr<HttpExchange>& ex, const std::string& endpoint, const ApiError& e);
  bool authorised(const HttpRequest& req) const;
  std::string new_id(const char* prefix);

  ApiOptions opts_;
  Scheduler* scheduler_;
  const TextCodec* codec_;
  GatewayMetrics* metrics_;
  int64_t started_at_;  // unix seconds, the models' "created"
  std::mt19937_64 rng_;  // response ids and seeds of requests without one
};

}  // namespace moe::gw
