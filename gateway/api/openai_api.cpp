#include "gateway/api/openai_api.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <ctime>
#ifdef __GLIBC__
#include <malloc.h>
#endif

#include <nlohmann/json.hpp>
#include <uv.h>

#include "gateway/api/generation.h"
#include "gateway/json_body.h"
#include "gateway/last_resort.h"
#include "gateway/api/prediction_debug.h"
#include "gateway/api/tokenize_api.h"
#include "gateway/observe/expert_view.h"
#include "gateway/observe/experts_page.h"
#include "gateway/state/sha256.h"
#include "protocol/redis_schema.h"

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
constexpr const char* kTokenize = "/tokenize";
constexpr const char* kDetokenize = "/detokenize";
constexpr const char* kExperts = "/experts";          // the page (gateway/observe/experts_page.h)
constexpr const char* kExpertsJson = "/experts.json";  // its data, once a second

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
      grammars_(codec),
      metrics_(metrics),
      admission_(opts_.admission),
      started_at_(static_cast<int64_t>(std::time(nullptr))),
      rng_(std::random_device{}()),
      held_responses_(std::make_shared<HeldResponseBytes>()) {
  held_responses_->limit = opts_.max_held_response_bytes;
  // Every key as its digest: a plain key and the same key in the keys file
  // are one caller with the same sessions, and the file's priority and rate
  // limit hold for it.
  keys_ = opts_.keys;
  for (const std::string& k : opts_.api_keys) {
    ApiKeyEntry e;
    e.sha256_hex = sha256_hex(k);
    e.name = "key-" + e.sha256_hex.substr(0, 8);
    if (std::none_of(keys_.begin(), keys_.end(), [&](const ApiKeyEntry& f) { return f.sha256_hex == e.sha256_hex; }))
      keys_.push_back(std::move(e));
  }
  for (const ApiKeyEntry& k : keys_)
    key_owners_.push_back(protocol::session_owner_of_key(k.sha256_hex.substr(0, 32)));
}

std::string OpenAiApi::new_id(const char* prefix) {
  static const char* hex = "0123456789abcdef";
  std::string id = prefix;
  uint64_t a = rng_(), b = rng_();
  for (int i = 0; i < 16; ++i) id += hex[(a >> (i * 4)) & 15];
  for (int i = 0; i < 8; ++i) id += hex[(b >> (i * 4)) & 15];
  return id;
}

int OpenAiApi::key_index(const HttpRequest& req, bool basic) const {
  const std::string* h = req.header("authorization");
  if (!h || h->size() < 7) return -1;
  std::string scheme = h->substr(0, 7);
  for (char& c : scheme) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  std::string key;
  if (scheme == "bearer ") {
    key = h->substr(7);
  } else if (basic && scheme.substr(0, 6) == "basic ") {
    // A browser's login, for the experts page only: any user name, the key
    // as the password. Elsewhere it would let any other site's page post
    // with the browser's cached login.
    auto pw = basic_auth_password(std::string_view(*h).substr(6));
    if (!pw) return -1;
    key = std::move(*pw);
  } else {
    return -1;
  }
  const std::string given = sha256_hex(key);
  // Every digest is compared, so the time taken says nothing of which matched.
  int found = -1;
  for (size_t i = 0; i < keys_.size(); ++i)
    if (constant_time_equal(given, keys_[i].sha256_hex) && found < 0) found = int(i);
  return found;
}

void OpenAiApi::reply(const std::shared_ptr<HttpExchange>& ex, const std::string& endpoint, HttpResponse r) {
  metrics_->count_request(endpoint, r.status);
  ex->respond(std::move(r));
}

void OpenAiApi::reply_error(const std::shared_ptr<HttpExchange>& ex, const std::string& endpoint, const ApiError& e) {
  reply(ex, endpoint, api_error_response(e));
}

void OpenAiApi::reply_retry_later(const std::shared_ptr<HttpExchange>& ex, const std::string& endpoint,
                                  const ApiError& e, uint64_t retry_after_s) {
  HttpResponse r = api_error_response(e);
  r.headers.emplace_back("Retry-After", std::to_string(retry_after_s));
  reply(ex, endpoint, std::move(r));
}

HttpResponse OpenAiApi::protocol_error(int status, const std::string& message) {
  const char* code = status == 413   ? "request_too_large"
                     : status == 408 ? "request_timeout"
                     : status == 431 ? "request_header_too_large"
                     : status == 411 ? "length_required"
                     : status == 503 ? "too_many_connections"
                     : status == 501 ? "not_implemented"             // a request the server does not take
                     : status == 505 ? "http_version_not_supported"  // (the client's, not a server fault)
                     : status >= 500 ? "internal_error"
                                     : "bad_request";
  metrics_->count_request("invalid", status);
  const bool server_fault = status >= 500 && status != 501 && status != 505;
  return api_error_response(
      ApiError{status, message, server_fault ? "server_error" : "invalid_request_error", "", code});
}

namespace {

// One request's work on the thread pool and what follows it on the loop.
struct PoolJob {
  uv_work_t req{};
  std::function<void()> work;
  std::function<void(bool failed)> finish;  // on the loop
  std::atomic<bool> cancelled{false};       // the client left: the work need not run
  bool failed = false;
};

// Parses waiting for or on the pool at once: past this a request is 503
// (the pool has four threads; a backlog only delays every request's start).
constexpr size_t kMaxPoolJobs = 64;
// Once half the queue is taken, a caller holding this many large requests
// (a body of kLargeBody or more: what takes a pool thread long) is refused
// a next large one (429), so that one client flooding long prompts leaves
// the other half to everyone else. Short requests are not counted: a
// client's burst of 64 short ones passes as before.
constexpr size_t kPoolJobsShared = kMaxPoolJobs / 2;
constexpr size_t kPoolJobsPerCallerPastShared = 8;
constexpr size_t kLargeBody = 64 * 1024;

}  // namespace

void OpenAiApi::reply_off_loop(const std::shared_ptr<HttpExchange>& ex, const char* endpoint,
                               const std::string& caller, std::function<HttpResponse()> make) {
  auto out = std::make_shared<HttpResponse>();
  off_loop(ex, endpoint, caller, [out, make = std::move(make)] { *out = make(); },
           [this, ex, endpoint, out] { reply(ex, endpoint, std::move(*out)); });
}

void OpenAiApi::off_loop(const std::shared_ptr<HttpExchange>& ex, const char* endpoint, const std::string& caller,
                         std::function<void()> work, std::function<void()> then, bool admitted) {
  auto fail = [this, ex, endpoint] {
    reply_error(ex, endpoint,
                ApiError{500, "Internal error while reading the request.", "server_error", "", "internal_error"});
  };
  if (!server_) {
    if (!last_resort("a request's text", work)) return fail();
    return then();
  }
  if (!admitted && jobs_in_flight_ >= kMaxPoolJobs)
    return reply_retry_later(ex, endpoint,
                             ApiError{503, "Too many requests are being read at once; retry shortly.", "server_error",
                                      "", "server_busy"},
                             1);
  const bool large = ex->request().body.size() >= kLargeBody;
  if (!admitted && large && jobs_in_flight_ >= kPoolJobsShared) {
    auto it = pool_jobs_by_caller_.find(caller);
    if (it != pool_jobs_by_caller_.end() && it->second >= kPoolJobsPerCallerPastShared) {
      ++pool_share_refused_;
      return reply_retry_later(ex, endpoint,
                               ApiError{429,
                                        "Too many of this caller's large requests are being read at once (" +
                                            std::to_string(it->second) + ") while the server is busy; retry shortly.",
                                        "rate_limit_error", "", "too_many_requests_reading"},
                               1);
    }
  }
  auto* job = new PoolJob;
  job->work = std::move(work);
  auto release = [this, caller, large] {
    --jobs_in_flight_;
    if (!large) return;
    auto it = pool_jobs_by_caller_.find(caller);
    if (it != pool_jobs_by_caller_.end() && --it->second == 0) pool_jobs_by_caller_.erase(it);
  };
  job->finish = [this, ex, fail, release, then = std::move(then)](bool failed) {
    release();
    ex->on_abort(nullptr);  // the job is gone after this
    // The client may have gone while its text was read: then nothing runs.
    if (!ex->open()) {
      metrics_->count_disconnect();
      return;
    }
    if (failed) return fail();
    // As after a session's load: whatever throws here still answers.
    if (!last_resort("a request after its text was read", then) && ex->open()) fail();
  };
  job->req.data = job;
  // A client that leaves (or a shutdown) takes its job off the queue, or
  // tells a running one to skip the work.
  ex->on_abort([job] {
    job->cancelled = true;
    (void)uv_cancel(reinterpret_cast<uv_req_t*>(&job->req));
  });
  ++jobs_in_flight_;
  if (large) ++pool_jobs_by_caller_[caller];
  const int rc = uv_queue_work(
      server_->loop(), &job->req,
      [](uv_work_t* w) {
        auto* j = static_cast<PoolJob*>(w->data);
        if (j->cancelled) return;
        j->failed = !last_resort("a request's text (thread pool)", j->work);
      },
      [](uv_work_t* w, int status) {
        // Deleted here, on the loop: what `finish` holds (a session's turn
        // mark among it) is let go where the loop's state lives.
        std::unique_ptr<PoolJob> j(static_cast<PoolJob*>(w->data));
        j->finish(j->failed || status != 0 || j->cancelled);
      });
  if (rc != 0) {
    ex->on_abort(nullptr);
    delete job;
    release();
    fail();
  }
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
  } else if (path == kTokenize) {
    route = {kTokenize, "POST"};
  } else if (path == kDetokenize) {
    route = {kDetokenize, "POST"};
  } else if (path == kDebugExperts && opts_.predictor) {
    route = {kDebugExperts, "POST"};
  } else if ((path == kExperts || path == kExpertsJson) && opts_.experts_page && scheduler_->expert_view()) {
    route = {path == kExperts ? kExperts : kExpertsJson, "GET"};
  }
  const bool page = route.endpoint == kExperts || route.endpoint == kExpertsJson;
  // The key first: without it nothing, not even which routes exist, is told
  // (but for the experts page's two paths, whose challenge lets a browser log in).
  Caller caller;
  if (route.endpoint != kHealth && !keys_.empty()) {
    // A Basic login (a browser's, for the experts page) opens only the page's
    // paths, and tells a path that does not exist (the browser's favicon);
    // on an API route it is refused: another site's page could post with it.
    const int k = key_index(req, page || !route.endpoint);
    if (k < 0) {
      HttpResponse r = api_error_response(ApiError{
          401,
          req.header("authorization") ? "Incorrect API key provided." : "You didn't provide an API key. Send it as "
                                                                         "'Authorization: Bearer KEY'.",
          "invalid_request_error", "", "invalid_api_key"});
      // A browser opening the experts page logs in itself: the key as the password.
      r.headers.emplace_back("WWW-Authenticate", page ? "Basic realm=\"moe-gateway\", charset=\"UTF-8\"" : "Bearer");
      reply(ex, route.endpoint ? route.endpoint : "unknown", std::move(r));
      return;
    }
    caller.id = "key:" + key_owners_[size_t(k)];
    caller.session_owner = key_owners_[size_t(k)];
    caller.key = &keys_[size_t(k)];
  } else {
    caller.id = "addr:" + forwarded_client(req.peer, req.header("x-forwarded-for"), opts_.trusted_proxies);
    caller.session_owner = SessionStore::open_owner();
  }
  if (!route.endpoint) {
    reply_error(ex, "unknown",
                ApiError{404, "Unknown request URL: " + req.method + " " + path + ".", "invalid_request_error", "",
                         "unknown_url"});
    return;
  }
  // HEAD is GET without the body (the server leaves it out).
  const bool get = std::string_view(route.method) == "GET";
  if (req.method != route.method && !(get && req.method == "HEAD")) {
    HttpResponse r = api_error_response(ApiError{405,
                                                 "Method " + req.method + " is not allowed on " + path + "; use " +
                                                     route.method + ".",
                                                 "invalid_request_error", "", "method_not_allowed"});
    r.headers.emplace_back("Allow", get ? "GET, HEAD" : route.method);
    reply(ex, route.endpoint, std::move(r));
    return;
  }
  if (route.endpoint == kChat) return completions(ApiKind::chat, ex, caller);
  if (route.endpoint == kCompletions) return completions(ApiKind::completion, ex, caller);
  if (route.endpoint == kModels) return models(ex, path);
  if (route.endpoint == kHealth) return health(ex);
  if (route.endpoint == kDebugExperts) return debug_experts(ex);
  if (page) return experts_page(ex, route.endpoint == kExperts);
  if (route.endpoint == kTokenize)
    return reply_off_loop(ex, kTokenize, caller.id,
                          [body = ex->request().body, codec = codec_, name = opts_.served_model_name,
                           max_context = scheduler_->ready() ? scheduler_->max_context() : 0] {
                            return tokenize_response(body, *codec, name, max_context);
                          });
  if (route.endpoint == kDetokenize)  // a long list of ids is decoded off the loop too
    return reply_off_loop(ex, kDetokenize, caller.id, [body = ex->request().body, codec = codec_, name = opts_.served_model_name] {
      return detokenize_response(body, *codec, name);
    });
  metrics(ex);
}

void OpenAiApi::completions(ApiKind kind, const std::shared_ptr<HttpExchange>& ex, const Caller& caller) {
  auto parsed = std::make_shared<ParsedJson>();
  // The exchange outlives the job (the job is let go on the loop), and
  // nothing writes its request meanwhile.
  off_loop(ex, kind == ApiKind::chat ? kChat : kCompletions, caller.id,
           [parsed, ex] { *parsed = parse_json_body(ex->request().body); },
           [this, kind, ex, caller, parsed] { completions_parsed(kind, ex, caller, std::move(*parsed)); });
}

void OpenAiApi::completions_parsed(ApiKind kind, const std::shared_ptr<HttpExchange>& ex, const Caller& caller,
                                   ParsedJson parsed) {
  const char* endpoint = kind == ApiKind::chat ? kChat : kCompletions;
  if (auto* err = std::get_if<ApiError>(&parsed)) return reply_error(ex, endpoint, *err);
  json body = std::move(std::get<json>(parsed));
  // Sessions (chat only): `session_id` in the body or an X-Session-Id header
  // names a stored conversation of this caller; its turns go before the new
  // ones. "new" asks the server for a fresh id.
  SessionKey session;
  bool fresh = false;
  if (kind == ApiKind::chat && opts_.sessions) {
    std::string id;
    if (body.is_object()) {
      auto it = body.find("session_id");
      if (it != body.end() && !it->is_null()) {
        if (!it->is_string())
          return reply_error(ex, kChat, invalid_param("session_id", "'session_id' must be a string.", "invalid_type"));
        id = it->get<std::string>();
        if (id.empty())
          return reply_error(ex, kChat,
                             ApiError{400, "session_id must be 1-128 characters of letters, digits, '_', '-', '.', ':'.",
                                      "invalid_request_error", "session_id", "invalid_session_id"});
      }
    }
    if (const std::string* h = ex->request().header("x-session-id"); h && !h->empty()) {
      // Both may name the session, but not two different ones.
      if (!id.empty() && id != *h)
        return reply_error(ex, kChat,
                           ApiError{400,
                                    "The X-Session-Id header and the body's session_id name different sessions ('" +
                                        h->substr(0, 128) + "' and '" + id.substr(0, 128) + "'); send one of them.",
                                    "invalid_request_error", "session_id", "conflicting_session_id"});
      id = *h;
    }
    if (body.is_object()) body.erase("session_id");
    if (id == "new") {
      id = SessionStore::issue_id();
      fresh = true;
    } else if (!id.empty() && !SessionStore::valid_id(id)) {
      return reply_error(ex, kChat,
                         ApiError{400, "session_id must be 1-128 characters of letters, digits, '_', '-', '.', ':'.",
                                  "invalid_request_error", "session_id", "invalid_session_id"});
    } else if (!id.empty() && keys_.empty() && !SessionStore::issued_shape(id)) {
      // Without API keys nobody is known: only an id the server issued
      // (unguessable) keeps a conversation private.
      return reply_error(ex, kChat,
                         ApiError{400,
                                  "Without API keys this server issues session ids itself: send \"session_id\": "
                                  "\"new\" and use the X-Session-Id of the response.",
                                  "invalid_request_error", "session_id", "invalid_session_id"});
    }
    if (!id.empty()) session = SessionKey{caller.session_owner, id, caller.id};
  }
  if (session.id.empty() || fresh) return run_completion(kind, ex, caller, std::move(body), session, {});
  const std::string busy_key = session.owner + "\n" + session.id;
  if (busy_sessions_->count(busy_key))
    return reply_retry_later(
        ex, kChat,
        ApiError{409, "A turn of this session is still running; send the next one when it has ended (a retry with "
                      "the same Idempotency-Key then gets the stored answer).",
                 "invalid_request_error", "session_id", "session_busy"},
        1);
  busy_sessions_->insert(busy_key);
  struct TurnMark {
    std::weak_ptr<std::unordered_set<std::string>> busy;
    std::string key;
    ~TurnMark() {
      if (auto b = busy.lock()) b->erase(key);
    }
  };
  auto mark = std::make_shared<TurnMark>();  // built in place: a temporary's end would unmark it
  mark->busy = busy_sessions_;
  mark->key = busy_key;
  std::shared_ptr<const void> turn = std::move(mark);
  opts_.sessions->load(session, [this, kind, ex, caller, body = std::move(body), session,
                                 turn = std::move(turn)](ChatMessages prior, bool known) mutable {
    // The client may have gone while Redis answered: then nothing runs.
    if (!ex->open()) {
      metrics_->count_disconnect();
      return;
    }
    // Without keys an id is only good while the server holds its session:
    // one of the issued shape that it never issued (or whose session expired)
    // would otherwise start a conversation under an id the client chose.
    if (!known && session.owner == SessionStore::open_owner()) {
      reply_error(ex, kChat,
                  ApiError{404,
                           "No session has this id (never issued, or expired): send \"session_id\": \"new\" to "
                           "start one.",
                           "invalid_request_error", "session_id", "session_not_found"});
      return;
    }
    // Called from a Redis reply: a failure here must still answer the client.
    if (!last_resort("a request after its session loaded",
                     [&] { run_completion(kind, ex, caller, std::move(body), session, std::move(prior), turn); }) &&
        ex->open())
      reply_error(ex, kChat, ApiError{500, "Internal error while starting the request.", "server_error", "",
                                      "internal_error"});
  });
}

void OpenAiApi::replay(const std::shared_ptr<HttpExchange>& ex, const CompletionRequest& req, const SessionKey& session,
                       const ChatMessage& stored) {
  // The turn this key names was answered and stored already (its answer
  // was lost on the way, or the client retried): the stored answer, once.
  json message = {{"role", "assistant"}, {"content", stored.content}};
  if (!stored.tool_calls.empty()) message["tool_calls"] = json::parse(stored.tool_calls, nullptr, false);
  const std::string finish = !stored.finish_reason.empty() ? stored.finish_reason
                             : stored.tool_calls.empty()   ? "stop"
                                                           : "tool_calls";
  const std::string& model = req.model;
  // The response as it was sent: its id, time and usage (a turn stored
  // before these were kept gets a new id and no counts).
  const std::string id = !stored.response_id.empty() ? stored.response_id : new_id("chatcmpl-");
  const int64_t created = stored.created != 0 ? stored.created : static_cast<int64_t>(std::time(nullptr));
  json usage = stored.usage.empty() ? json() : json::parse(stored.usage, nullptr, false);
  if (!usage.is_object()) usage = {{"prompt_tokens", 0}, {"completion_tokens", 0}, {"total_tokens", 0}};
  HttpHeaders headers = {{"X-Session-Id", session.id}, {"X-Moe-Replayed", "1"}};
  ++replayed_;
  if (!req.stream) {
    HttpResponse r;
    r.headers = {{"Content-Type", "application/json"}};
    r.headers.insert(r.headers.end(), headers.begin(), headers.end());
    r.body = json_text(json{{"id", id},
                            {"object", "chat.completion"},
                            {"created", created},
                            {"model", model},
                            {"choices", json::array({{{"index", 0}, {"message", message}, {"logprobs", nullptr},
                                                      {"finish_reason", finish}}})},
                            {"usage", usage}});
    return reply(ex, kChat, std::move(r));
  }
  headers.insert(headers.begin(), {{"Content-Type", "text/event-stream"}, {"Cache-Control", "no-cache"}});
  ex->begin_stream(200, std::move(headers));
  metrics_->count_request(kChat, 200);
  auto chunk = [&](json delta, json finish) {
    return "data: " +
           json_text(json{{"id", id},
                          {"object", "chat.completion.chunk"},
                          {"created", created},
                          {"model", model},
                          {"choices", json::array({{{"index", 0}, {"delta", std::move(delta)}, {"logprobs", nullptr},
                                                    {"finish_reason", std::move(finish)}}})}}) +
           "\n\n";
  };
  message.erase("role");
  if (message.contains("tool_calls") && message["tool_calls"].is_array())
    for (size_t i = 0; i < message["tool_calls"].size(); ++i) message["tool_calls"][i]["index"] = i;
  ex->send(chunk({{"role", "assistant"}, {"content", ""}}, nullptr));
  ex->send(chunk(message, nullptr));
  ex->send(chunk(json::object(), finish));
  if (req.include_usage)
    ex->send("data: " +
             json_text(json{{"id", id},
                            {"object", "chat.completion.chunk"},
                            {"created", created},
                            {"model", model},
                            {"choices", json::array()},
                            {"usage", usage}}) +
             "\n\n");
  ex->send("data: [DONE]\n\n");
  ex->end();
}

void OpenAiApi::run_completion(ApiKind kind, const std::shared_ptr<HttpExchange>& ex, const Caller& caller,
                               json body, const SessionKey& session, ChatMessages prior,
                               std::shared_ptr<const void> turn) {
  const char* endpoint = kind == ApiKind::chat ? kChat : kCompletions;
  // A session turn may carry an Idempotency-Key: the same key again (a
  // retry) is answered from the store when its turn was stored already.
  std::string request_key, request_digest;
  std::optional<ChatMessage> replay_of;
  if (!session.id.empty()) {
    if (const std::string* k = ex->request().header("idempotency-key")) {
      request_key = *k;
      const bool printable = std::all_of(request_key.begin(), request_key.end(),
                                         [](char c) { return c > 0x20 && c < 0x7f; });
      if (request_key.empty() || request_key.size() > 128 || !printable)
        return reply_error(ex, endpoint,
                           ApiError{400, "Idempotency-Key must be 1-128 printable characters without spaces.",
                                    "invalid_request_error", "", "invalid_idempotency_key"});
      // The same key names the same turn: a digest of its new messages
      // tells a retry from a key reused for another turn.
      const auto msgs = body.find("messages");
      request_digest = sha256_hex(msgs == body.end() ? std::string() : msgs->dump()).substr(0, 32);
      // Any stored turn of this key, the last or one before later turns (a
      // retry that comes late): that turn again, never run and stored twice.
      for (auto it = prior.rbegin(); it != prior.rend(); ++it) {
        if (it->role != "assistant" || it->request_key != request_key) continue;
        if (it->request_digest != request_digest)
          return reply_error(ex, endpoint,
                             ApiError{422, "This Idempotency-Key answered another turn of the session; use a new key "
                                           "for a new turn.", "invalid_request_error", "", "idempotency_key_reused"});
        replay_of = *it;
        break;
      }
    }
  }
  auto job = std::make_shared<CompletionJob>();
  job->kind = kind;
  job->ex = ex;
  job->caller = caller;
  job->body = std::move(body);
  job->session = session;
  job->prior = std::move(prior);
  job->turn = std::move(turn);
  job->request_key = std::move(request_key);
  job->request_digest = std::move(request_digest);
  // A replay is checked as the request it repeats was (its parameters, its
  // model, its new turns), though nothing runs: parsed without the stored
  // turns, which hold its answer already.
  if (replay_of) job->prior.clear();
  job->replay_of = std::move(replay_of);
  parse_then_start(std::move(job), 0);
}

RequestLimits OpenAiApi::limits_now() const {
  RequestLimits limits;
  limits.served_model_name = opts_.served_model_name;
  limits.max_context = scheduler_->ready() ? scheduler_->max_context() : 0;
  limits.kv_capacity = scheduler_->ready() ? scheduler_->kv_capacity() : 0;
  limits.max_choices = opts_.max_choices;
  limits.max_request_tokens = opts_.max_request_tokens;
  limits.max_logprob_entries = opts_.max_logprob_entries;
  return limits;
}

void OpenAiApi::parse_then_start(std::shared_ptr<CompletionJob> job, int attempt) {
  // Parsing tokenises the prompt (or renders and tokenises the chat): on
  // the thread pool, the loop serving the other connections meanwhile.
  job->limits = limits_now();
  job->parsed.reset();
  const auto ex = job->ex;
  off_loop(ex, job->kind == ApiKind::chat ? kChat : kCompletions, job->caller.id,
           [job, codec = codec_] {
             job->parsed.emplace(parse_completion_request(job->kind, job->body, *codec, job->limits, job->prior));
           },
           [this, job, attempt]() mutable {
             // The serving workers' limits changed while it was parsed (one
             // came up, went down or was replaced): parse it again against
             // them, as when it arrived.
             const RequestLimits now = limits_now();
             if ((now.max_context != job->limits.max_context || now.kv_capacity != job->limits.kv_capacity) &&
                 attempt < 2)
               return parse_then_start(std::move(job), attempt + 1);
             start_completion(*job);
             // Nothing reads the body after this: a large one's tree is
             // freed on the thread pool (freeing 330,000 numbers held the loop for tens of ms).
             if (job->ex->request().body.size() >= kFreeOffLoopBytes) free_off_loop(std::move(job->body));
           },
           /*admitted=*/true);
}

struct OpenAiApi::Trimmer {
  uv_timer_t timer;
  std::weak_ptr<HeldResponseBytes> held;
};

void OpenAiApi::watch_server(const HttpServer* server) {
  server_ = server;
#ifdef __GLIBC__
  // glibc keeps what a large response freed (186 MB resident, idle, after
  // four chat requests of n 32 with 20 alternatives a token): given back on
  // the thread pool. A trim holds the allocator's locks while it walks the
  // heap, so it waits until large responses stopped coming for a moment
  // (each asks again, which pushes it back: their bodies and trees are freed
  // after them), and runs only while none is held. The timer is
  // unreferenced (it keeps no loop running) and closed by close().
  if (trimmer_) return;
  auto* trimmer = trimmer_ = new Trimmer{{}, held_responses_};
  uv_timer_init(server->loop(), &trimmer->timer);
  uv_unref(reinterpret_cast<uv_handle_t*>(&trimmer->timer));
  trimmer->timer.data = trimmer;
  held_responses_->trim = [trimmer] {
    uv_timer_start(
        &trimmer->timer,
        [](uv_timer_t* t) {
          auto held = static_cast<Trimmer*>(t->data)->held.lock();
          if (!held || held->trimming || held->total > 0) return;
          struct Trim {
            uv_work_t req;
            std::shared_ptr<HeldResponseBytes> held;
          };
          auto* w = new Trim{{}, held};
          w->req.data = w;
          held->trimming = true;
          if (uv_queue_work(
                  t->loop, &w->req, [](uv_work_t*) { malloc_trim(0); },
                  [](uv_work_t* r, int) { std::unique_ptr<Trim>(static_cast<Trim*>(r->data))->held->trimming = false; }) !=
              0) {
            held->trimming = false;
            delete w;
          }
        },
        kTrimAfterMs, 0);
  };
#endif
}

void OpenAiApi::close() {
  if (!trimmer_) return;
  held_responses_->trim = nullptr;
  uv_close(reinterpret_cast<uv_handle_t*>(&trimmer_->timer),
           [](uv_handle_t* h) { delete static_cast<Trimmer*>(h->data); });
  trimmer_ = nullptr;
}

void OpenAiApi::free_off_loop(json tree) {
  if (!server_) return;  // no loop of ours (tests): freed here
  struct Held {
    uv_work_t req;
    json tree;
  };
  auto* h = new Held{{}, std::move(tree)};
  h->req.data = h;
  const int rc = uv_queue_work(
      server_->loop(), &h->req, [](uv_work_t* w) { static_cast<Held*>(w->data)->tree = json(); },
      [](uv_work_t* w, int) { delete static_cast<Held*>(w->data); });
  if (rc != 0) delete h;  // freed here after all
}

void OpenAiApi::start_completion(CompletionJob& job) {
  const ApiKind kind = job.kind;
  const std::shared_ptr<HttpExchange>& ex = job.ex;
  const Caller& caller = job.caller;
  const json& body = job.body;
  const SessionKey& session = job.session;
  ParsedRequest& parsed = *job.parsed;
  const char* endpoint = kind == ApiKind::chat ? kChat : kCompletions;
  if (auto* err = std::get_if<ApiError>(&parsed)) return reply_error(ex, endpoint, *err);
  if (!job.request_key.empty()) {
    // What the session stores of a turn (one answer, no logprobs) is all a
    // retry can be answered with: a keyed turn asks for no more.
    const CompletionRequest& asked = std::get<CompletionRequest>(parsed);
    if (asked.n > 1 || asked.best_of > 1 || asked.sampling.logprobs)
      return reply_error(ex, endpoint,
                         invalid_param(asked.sampling.logprobs ? "logprobs" : "n",
                                       "A session turn with an Idempotency-Key is answered again from what the "
                                       "session stores of it: one choice, without logprobs. Ask for n 1 and no "
                                       "logprobs, or send no key.",
                                       "unsupported_value"));
  }
  if (job.replay_of) return replay(ex, std::get<CompletionRequest>(parsed), session, *job.replay_of);
  if (!scheduler_->ready()) {
    // A worker (re)starting, or one that keeps failing before it is ready.
    const std::string failing = scheduler_->failing();
    return reply_retry_later(
        ex, endpoint,
        failing.empty() ? ApiError{503, "The engine is not ready yet; retry shortly.", "server_error", "", "engine_not_ready"}
                        : ApiError{503, failing, "server_error", "", "engine_failing"},
        failing.empty() ? 1 : 5);
  }
  // Priority: the key's, or the body's where the operator allows it (never
  // earlier than the key's own).
  int priority = caller.key ? caller.key->priority : 0;
  if (auto p = body.find("priority"); p != body.end() && !p->is_null()) {
    const bool integral = p->is_number_integer() || (p->is_number_float() && p->get<double>() == std::floor(p->get<double>()));
    if (!integral || p->get<double>() < kMinPriority || p->get<double>() > kMaxPriority)
      return reply_error(ex, endpoint, invalid_param("priority", "'priority' must be an integer from " +
                                                         std::to_string(kMinPriority) + " to " +
                                                         std::to_string(kMaxPriority) + " (lower runs first).",
                                                     "invalid_value"));
    const int asked = int(p->get<double>());
    if (!opts_.allow_request_priority && asked != 0)
      return reply_error(ex, endpoint, invalid_param("priority", "'priority' is not enabled on this server (its "
                                                     "operator may allow it: --request-priority on).",
                                                     "unsupported_parameter"));
    priority = std::max(priority, asked);
  }
  if (caller.key && caller.key->rate_per_minute > 0) {
    uint64_t wait_ms = 0;
    if (!rate_limiter_.allow(caller.key->name, caller.key->rate_per_minute, uv_hrtime() / 1000000, &wait_ms)) {
      ++rate_limited_;
      return reply_retry_later(ex, endpoint,
                               ApiError{429,
                                        "Rate limit reached for key '" + caller.key->name + "': " +
                                            std::to_string(caller.key->rate_per_minute) + " requests a minute.",
                                        "rate_limit_error", "", "rate_limit_exceeded"},
                               std::max<uint64_t>(1, (wait_ms + 999) / 1000));
    }
  }
  CompletionRequest req = std::move(std::get<CompletionRequest>(parsed));
  const int sequences = static_cast<int>(req.prompts.size()) * std::max(req.n, req.best_of);
  const SchedulerStats now = scheduler_->stats();
  auto admitted = admission_.admit(caller.id, sequences, now.waiting);
  if (auto* err = std::get_if<ApiError>(&admitted))
    return reply_retry_later(ex, endpoint, *err, uint64_t(admission_.limits().retry_after_s));
  // Overload: too much waits for the main workers ahead of this request
  // (its priority or earlier); the fallback takes it when its context
  // holds it, else it is refused (docs/operations.md).
  bool on_fallback = false;
  if (!now.degraded && (opts_.overload_queue_depth > 0 || opts_.overload_wait_ms > 0)) {
    const OverloadView ov = scheduler_->overload(priority);
    const bool overloaded = (opts_.overload_queue_depth > 0 && ov.waiting >= opts_.overload_queue_depth) ||
                            (opts_.overload_wait_ms > 0 && ov.oldest_wait_ms >= opts_.overload_wait_ms);
    bool fits_fallback = ov.fallback_ready;
    // Without max_tokens a choice may end at the fallback's context (length).
    for (const auto& p : req.prompts)
      fits_fallback &= ov.fallback_max_context <= 0 ||
                       int64_t(p.size()) + (req.max_tokens_given ? req.max_new_tokens : 1) <=
                           int64_t(ov.fallback_max_context);
    if (overloaded && fits_fallback) {
      on_fallback = true;
      ++overload_fallback_;
    } else if (overloaded) {
      ++overload_refused_;
      return reply_retry_later(ex, endpoint,
                               ApiError{429,
                                        "The server is overloaded: " + std::to_string(ov.waiting) +
                                            " sequences wait ahead of this request, the oldest for " +
                                            std::to_string(ov.oldest_wait_ms / 1000) + " s" +
                                            (ov.fallback_ready ? "; the fallback's context is too small for it" : "") +
                                            "; retry shortly.",
                                        "rate_limit_error", "", "overloaded"},
                               std::clamp<uint64_t>((ov.oldest_wait_ms + 999) / 1000, 1, 30));
    }
  }
  uint64_t seed = req.seed_given ? req.sampling.seed : rng_();

  GenerationContext ctx;
  ctx.scheduler = scheduler_;
  ctx.codec = codec_;
  ctx.grammars = &grammars_;
  ctx.metrics = metrics_;
  ctx.endpoint = endpoint;
  ctx.response_id = new_id(kind == ApiKind::chat ? "chatcmpl-" : "cmpl-");
  // The response's id as clients' SDKs read it (their request id), for logs on both sides.
  ctx.extra_headers.emplace_back("X-Request-Id", ctx.response_id);
  ctx.created = static_cast<int64_t>(std::time(nullptr));
  ctx.start_ns = uv_hrtime();
  ctx.degraded = now.degraded || on_fallback;
  ctx.on_fallback = on_fallback;
  ctx.priority = priority;
  ctx.caller = std::hash<std::string>{}(caller.id) | 1;  // never 0 (unknown)
  ctx.request_serial = next_request_serial_++;
  ctx.max_response_bytes = opts_.max_response_bytes;
  ctx.held_total = held_responses_;
  ctx.ticket = std::move(std::get<AdmissionTicket>(admitted));
  if (req.trimmed_messages > 0 || req.trimmed_tokens > 0)
    ctx.extra_headers.emplace_back("X-Moe-Context-Trimmed", "messages=" + std::to_string(req.trimmed_messages) +
                                                                ", tokens=" + std::to_string(req.trimmed_tokens));
  if (!session.id.empty()) {
    ctx.extra_headers.emplace_back("X-Session-Id", session.id);
    // The stored turns, this request's (validated) turns and the reply.
    ChatMessages conversation = std::move(job.prior);
    conversation.insert(conversation.end(), req.messages.begin(), req.messages.end());
    SessionStore* store = opts_.sessions;
    ctx.on_complete = [store, session, request_key = job.request_key, request_digest = job.request_digest,
                       conversation = std::move(conversation),
                       turn = std::move(job.turn)](const ChatMessage& reply, std::function<void()> then) mutable {
      conversation.push_back(reply);
      // What a retry needs, only for a turn that can be retried by its key.
      conversation.back().request_key = request_key;
      conversation.back().request_digest = request_key.empty() ? std::string() : request_digest;
      if (request_key.empty()) {  // nothing to answer a retry with
        conversation.back().finish_reason.clear();
        conversation.back().response_id.clear();
        conversation.back().created = 0;
        conversation.back().usage.clear();
      }
      store->save(session, std::move(conversation), std::move(then));
    };
  }
  auto gen = std::make_shared<Generation>(std::move(ctx), std::move(req), ex);
  gen->start(seed);
}

void OpenAiApi::models(const std::shared_ptr<HttpExchange>& ex, const std::string& path) {
  const std::string backend = scheduler_->backend();
  json model = {{"id", opts_.served_model_name},
                {"object", "model"},
                {"created", started_at_},
                {"owned_by", "moe-serve"},
                {"backend", backend.empty() ? json(nullptr) : json(backend)}};
  HttpResponse r;
  r.headers = {{"Content-Type", "application/json"}};
  if (path == kModels) {
    r.body = json_text(json{{"object", "list"}, {"data", json::array({model})}});
    return reply(ex, kModels, std::move(r));
  }
  std::string id = path.substr(std::string(kModels).size() + 1);
  if (id != opts_.served_model_name) {
    return reply_error(ex, kModels,
                       ApiError{404, "The model '" + id + "' does not exist.", "invalid_request_error", "model",
                                "model_not_found"});
  }
  r.body = json_text(model);
  reply(ex, kModels, std::move(r));
}

void OpenAiApi::health(const std::shared_ptr<HttpExchange>& ex) {
  bool ready = scheduler_->ready();
  SchedulerStats s = scheduler_->stats();
  HttpResponse r;
  r.status = ready ? 200 : 503;
  r.headers = {{"Content-Type", "application/json"}};
  if (s.degraded) r.headers.emplace_back("X-Moe-Degraded", "1");
  const std::string backend = scheduler_->backend();
  json redis = nullptr;  // no --redis
  if (opts_.redis_connected) redis = opts_.redis_connected() ? "connected" : "connecting";
  const std::string failing = ready ? "" : scheduler_->failing();
  json body{{"status", ready ? "ok" : failing.empty() ? "starting" : "failing"},
            {"degraded", s.degraded},
            {"backend", backend.empty() ? json(nullptr) : json(backend)},
            {"redis", redis}};
  if (!failing.empty()) body["error"] = failing;
  r.body = json_text(body);
  reply(ex, kHealth, std::move(r));
}

void OpenAiApi::experts_page(const std::shared_ptr<HttpExchange>& ex, bool page) {
  HttpResponse r;
  r.headers = {{"Cache-Control", "no-store"}};
  if (page) {
    r.headers.emplace_back("Content-Type", "text/html; charset=utf-8");
    r.body = experts_page_html();
    return reply(ex, kExperts, std::move(r));
  }
  // Being watched turns the figures on (resident sets, per-expert use) for a while.
  ExpertView* view = scheduler_->expert_view();
  view->watch(uv_hrtime() / 1000000);
  r.headers.emplace_back("Content-Type", "application/json");
  r.body = view->json();
  reply(ex, kExpertsJson, std::move(r));
}

void OpenAiApi::metrics(const std::shared_ptr<HttpExchange>& ex) {
  HttpResponse r;
  r.headers = {{"Content-Type", "text/plain; version=0.0.4; charset=utf-8"}};
  // Counted before rendering so that this scrape sees itself.
  metrics_->count_request(kMetrics, 200);
  GatewayGauges g;
  if (server_) {
    g.connections = server_->connection_count();
    g.connections_refused = server_->refused_connections();
  }
  g.sequences_admitted = admission_.in_flight();
  g.callers = admission_.callers();
  g.admission_refused = admission_.refused();
  g.generations = Generation::live();
  g.held_response_bytes = held_responses_->total;
  g.held_responses_refused = held_responses_->refused;
  if (opts_.sessions) {
    g.sessions_in_memory = opts_.sessions->in_memory();
    g.session_memory_bytes = opts_.sessions->memory_bytes();
  }
  g.internal_errors = escaped_exceptions();
  g.overload_fallback = overload_fallback_;
  g.overload_refused = overload_refused_;
  g.rate_limited = rate_limited_;
  g.reading_refused = pool_share_refused_;
  g.replayed = replayed_;
  r.body = metrics_->render(scheduler_->stats(), scheduler_->ready(), g);
  // Structured output's token masks (docs/structured-output.md).
  const structured::GrammarRegistry::Stats& gs = grammars_.stats();
  char buf[1024];
  std::snprintf(buf, sizeof buf,
                "# HELP moe_gateway_structured_masks_computed_total Token masks computed by a walk of the vocabulary.\n"
                "# TYPE moe_gateway_structured_masks_computed_total counter\nmoe_gateway_structured_masks_computed_total %llu\n"
                "# HELP moe_gateway_structured_mask_hits_total Token masks found in the cache.\n"
                "# TYPE moe_gateway_structured_mask_hits_total counter\nmoe_gateway_structured_mask_hits_total %llu\n"
                "# HELP moe_gateway_structured_mask_seconds_total Time spent computing token masks.\n"
                "# TYPE moe_gateway_structured_mask_seconds_total counter\nmoe_gateway_structured_mask_seconds_total %.6f\n"
                "# HELP moe_gateway_structured_mask_cache_bytes Bytes the mask cache holds.\n"
                "# TYPE moe_gateway_structured_mask_cache_bytes gauge\nmoe_gateway_structured_mask_cache_bytes %zu\n",
                static_cast<unsigned long long>(gs.masks_computed), static_cast<unsigned long long>(gs.mask_hits),
                gs.compute_seconds, gs.cache_bytes);
  r.body += buf;
  ex->respond(std::move(r));
}

void OpenAiApi::debug_experts(const std::shared_ptr<HttpExchange>& ex) {
  std::map<std::string, std::string> resident;
  if (opts_.resident_sets) resident = opts_.resident_sets();
  reply(ex, kDebugExperts, expert_prediction_response(ex->request().body, *codec_, *opts_.predictor, resident));
}

}  // namespace moe::gw
