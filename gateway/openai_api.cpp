#include "gateway/openai_api.h"

#include <ctime>

#include <nlohmann/json.hpp>
#include <uv.h>

#include "gateway/generation.h"
#include "gateway/prediction_debug.h"

namespace moe::gw {
namespace {

using json = nlohmann::json;

// Route names used as the metrics' endpoint label (never raw paths, which a
// client could make unbounded).
constexpr const char* kChat = "/v1/chat/completions";
constexpr const char* kCompletions = "/v1/completions";
constexpr const char* kModels = "/v1/models";
constexpr const char* kHealth = "/health";
constexpr const char* kMetrics = "/metrics";
constexpr const char* kDebugExperts = "/debug/experts";

bool constant_time_equal(const std::string& a, const std::string& b) {
  if (a.size() != b.size()) return false;
  unsigned char diff = 0;
  for (size_t i = 0; i < a.size(); ++i) diff |= static_cast<unsigned char>(a[i] ^ b[i]);
  return diff == 0;
}

}  // namespace

OpenAiApi::OpenAiApi(ApiOptions opts, Scheduler* scheduler, const TextCodec* codec, GatewayMetrics* metrics)
    : opts_(std::move(opts)),
      scheduler_(scheduler),
      codec_(codec),
      metrics_(metrics),
      started_at_(static_cast<int64_t>(std::time(nullptr))),
      rng_(std::random_device{}()) {}

std::string OpenAiApi::new_id(const char* prefix) {
  static const char* hex = "0123456789abcdef";
  std::string id = prefix;
  uint64_t a = rng_(), b = rng_();
  for (int i = 0; i < 16; ++i) id += hex[(a >> (i * 4)) & 15];
  for (int i = 0; i < 8; ++i) id += hex[(b >> (i * 4)) & 15];
  return id;
}

bool OpenAiApi::authorised(const HttpRequest& req) const {
  if (opts_.api_key.empty()) return true;
  const std::string* h = req.header("authorization");
  if (!h || h->size() < 7) return false;
  std::string scheme = h->substr(0, 7);
  for (char& c : scheme) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  if (scheme != "bearer ") return false;
  return constant_time_equal(h->substr(7), opts_.api_key);
}

void OpenAiApi::reply(const std::shared_ptr<HttpExchange>& ex, const std::string& endpoint, HttpResponse r) {
  metrics_->count_request(endpoint, r.status);
  ex->respond(std::move(r));
}

void OpenAiApi::reply_error(const std::shared_ptr<HttpExchange>& ex, const std::string& endpoint, const ApiError& e) {
  reply(ex, endpoint, api_error_response(e));
}

HttpResponse OpenAiApi::protocol_error(int status, const std::string& message) {
  const char* code = status == 413   ? "request_too_large"
                     : status == 408 ? "request_timeout"
                     : status == 431 ? "request_header_too_large"
                     : status == 411 ? "length_required"
                                     : "bad_request";
  metrics_->count_request("invalid", status);
  return api_error_response(ApiError{status, message, "invalid_request_error", "", code});
}

void OpenAiApi::handle(const std::shared_ptr<HttpExchange>& ex) {
  const HttpRequest& req = ex->request();
  const std::string& path = req.path;
  struct Route {
    const char* endpoint;
    const char* method;
  };
  Route route{nullptr, nullptr};
  if (path == kChat) {
    route = {kChat, "POST"};
  } else if (path == kCompletions) {
    route = {kCompletions, "POST"};
  } else if (path == kModels || path.rfind("/v1/models/", 0) == 0) {
    route = {kModels, "GET"};
  } else if (path == kHealth) {
    route = {kHealth, "GET"};
  } else if (path == kMetrics) {
    route = {kMetrics, "GET"};
  } else if (path == kDebugExperts && opts_.predictor) {
    route = {kDebugExperts, "POST"};
  }
  if (!route.endpoint) {
    reply_error(ex, "unknown",
                ApiError{404, "Unknown request URL: " + req.method + " " + path + ".", "invalid_request_error", "",
                         "unknown_url"});
    return;
  }
  if (route.endpoint != kHealth && !authorised(req)) {
    HttpResponse r = api_error_response(ApiError{
        401,
        req.header("authorization") ? "Incorrect API key provided." : "You didn't provide an API key. Send it as "
                                                                       "'Authorization: Bearer KEY'.",
        "invalid_request_error", "", "invalid_api_key"});
    r.headers.emplace_back("WWW-Authenticate", "Bearer");
    reply(ex, route.endpoint, std::move(r));
    return;
  }
  if (req.method != route.method) {
    HttpResponse r = api_error_response(ApiError{405,
                                                 "Method " + req.method + " is not allowed on " + path + "; use " +
                                                     route.method + ".",
                                                 "invalid_request_error", "", "method_not_allowed"});
    r.headers.emplace_back("Allow", route.method);
    reply(ex, route.endpoint, std::move(r));
    return;
  }
  if (route.endpoint == kChat) return completions(ApiKind::chat, ex);
  if (route.endpoint == kCompletions) return completions(ApiKind::completion, ex);
  if (route.endpoint == kModels) return models(ex, path);
  if (route.endpoint == kHealth) return health(ex);
  if (route.endpoint == kDebugExperts) return debug_experts(ex);
  metrics(ex);
}

void OpenAiApi::completions(ApiKind kind, const std::shared_ptr<HttpExchange>& ex) {
  // Sessions (chat only): `session_id` in the body or an X-Session-Id header
  // names a stored conversation; its messages go before the new ones.
  std::string session_id;
  if (kind == ApiKind::chat && opts_.sessions) {
    if (const std::string* h = ex->request().header("x-session-id")) session_id = *h;
    const std::string& body = ex->request().body;
    if (session_id.empty() && body.find("\"session_id\"") != std::string::npos) {
      json j = json::parse(body, nullptr, false);
      if (j.is_object() && j.contains("session_id") && j["session_id"].is_string()) session_id = j["session_id"];
    }
    if (!session_id.empty() && !SessionStore::valid_id(session_id)) {
      return reply_error(ex, kChat,
                         ApiError{400, "session_id must be 1-128 characters of letters, digits, '_', '-', '.', ':'.",
                                  "invalid_request_error", "session_id", "invalid_session_id"});
    }
  }
  if (session_id.empty()) return run_completion(kind, ex, "", json());
  opts_.sessions->load(session_id, [this, kind, ex, session_id](json prior) {
    run_completion(kind, ex, session_id, std::move(prior));
  });
}

void OpenAiApi::run_completion(ApiKind kind, const std::shared_ptr<HttpExchange>& ex, const std::string& session_id,
                               json prior) {
  const char* endpoint = kind == ApiKind::chat ? kChat : kCompletions;
  // With a session: the stored messages, then this request's, make the prompt.
  std::string merged_body;
  json conversation;
  if (!session_id.empty()) {
    json j = json::parse(ex->request().body, nullptr, false);
    if (j.is_object() && j.contains("messages") && j["messages"].is_array()) {
      conversation = prior.is_array() ? prior : json::array();
      for (auto& m : j["messages"]) conversation.push_back(m);
      j["messages"] = conversation;
      j.erase("session_id");
      merged_body = j.dump(-1, ' ', false, json::error_handler_t::replace);
    }
  }
  const std::string& body = merged_body.empty() ? ex->request().body : merged_body;
  RequestLimits limits;
  limits.served_model_name = opts_.served_model_name;
  limits.max_context = scheduler_->ready() ? scheduler_->max_context() : 0;
  limits.max_choices = opts_.max_choices;
  ParsedRequest parsed = parse_completion_request(kind, body, *codec_, limits);
  if (auto* err = std::get_if<ApiError>(&parsed)) return reply_error(ex, endpoint, *err);
  if (!scheduler_->ready()) {
    return reply_error(ex, endpoint,
                       ApiError{503, "The engine is not ready yet; retry shortly.", "server_error", "", "engine_not_ready"});
  }
  CompletionRequest req = std::move(std::get<CompletionRequest>(parsed));
  uint64_t seed = req.seed_given ? req.sampling.seed : rng_();

  GenerationContext ctx;
  ctx.scheduler = scheduler_;
  ctx.codec = codec_;
  ctx.metrics = metrics_;
  ctx.endpoint = endpoint;
  ctx.response_id = new_id(kind == ApiKind::chat ? "chatcmpl-" : "cmpl-");
  ctx.created = static_cast<int64_t>(std::time(nullptr));
  ctx.start_ns = uv_hrtime();
  ctx.degraded = scheduler_->stats().degraded;
  if (!session_id.empty() && conversation.is_array()) {
    ctx.extra_headers.emplace_back("X-Session-Id", session_id);
    SessionStore* store = opts_.sessions;
    ctx.on_complete = [store, session_id, conversation](const std::string& text) mutable {
      conversation.push_back({{"role", "assistant"}, {"content", text}});
      store->save(session_id, conversation);
    };
  }
  auto gen = std::make_shared<Generation>(std::move(ctx), std::move(req), ex);
  gen->start(seed);
}

void OpenAiApi::models(const std::shared_ptr<HttpExchange>& ex, const std::string& path) {
  json model = {{"id", opts_.served_model_name}, {"object", "model"}, {"created", started_at_}, {"owned_by", "moe-serve"}};
  HttpResponse r;
  r.headers = {{"Content-Type", "application/json"}};
  if (path == kModels) {
    r.body = json{{"object", "list"}, {"data", json::array({model})}}.dump();
    return reply(ex, kModels, std::move(r));
  }
  std::string id = path.substr(std::string(kModels).size() + 1);
  if (id != opts_.served_model_name) {
    return reply_error(ex, kModels,
                       ApiError{404, "The model '" + id + "' does not exist.", "invalid_request_error", "model",
                                "model_not_found"});
  }
  r.body = model.dump(-1, ' ', false, json::error_handler_t::replace);
  reply(ex, kModels, std::move(r));
}

void OpenAiApi::health(const std::shared_ptr<HttpExchange>& ex) {
  bool ready = scheduler_->ready();
  SchedulerStats s = scheduler_->stats();
  HttpResponse r;
  r.status = ready ? 200 : 503;
  r.headers = {{"Content-Type", "application/json"}};
  if (s.degraded) r.headers.emplace_back("X-Moe-Degraded", "1");
  r.body = json{{"status", ready ? "ok" : "starting"}, {"degraded", s.degraded}}.dump();
  reply(ex, kHealth, std::move(r));
}

void OpenAiApi::metrics(const std::shared_ptr<HttpExchange>& ex) {
  HttpResponse r;
  r.headers = {{"Content-Type", "text/plain; version=0.0.4; charset=utf-8"}};
  // Counted before rendering so that this scrape sees itself.
  metrics_->count_request(kMetrics, 200);
  r.body = metrics_->render(scheduler_->stats(), scheduler_->ready());
  ex->respond(std::move(r));
}

void OpenAiApi::debug_experts(const std::shared_ptr<HttpExchange>& ex) {
  std::map<std::string, std::string> resident;
  if (opts_.resident_sets) resident = opts_.resident_sets();
  reply(ex, kDebugExperts, expert_prediction_response(ex->request().body, *codec_, *opts_.predictor, resident));
}

}  // namespace moe::gw
