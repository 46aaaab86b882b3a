#pragma once
// The OpenAI-compatible HTTP API over a Scheduler: authentication, routing,
// admission, the endpoints, and OpenAI-shaped errors.
//
//   POST /v1/chat/completions   POST /v1/completions   (stream: SSE)
//   GET  /v1/models             GET  /v1/models/{id}
//   GET  /health (no auth)      GET  /metrics (Prometheus text)
//   POST /tokenize              POST /detokenize   (the served model's tokenizer: api/tokenize_api.h)
//   POST /debug/experts         (the expert prediction for a prompt; 404 while --predict off)
//
// The API key is checked before anything else (an unknown route without a
// key is 401, not 404), every body is parsed with parse_json_body's bounds,
// and a request is admitted (Admission) before its sequences are queued.
//
// Threading: loop thread only.

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <unordered_set>
#include <vector>

#include <nlohmann/json.hpp>

#include "gateway/admission.h"
#include "gateway/api_keys.h"
#include "gateway/json_body.h"
#include "gateway/api/completion_request.h"
#include "gateway/predict/expert_prediction.h"
#include "gateway/http/http_server.h"
#include "gateway/metrics.h"
#include "gateway/sched/scheduler.h"
#include "gateway/state/session_store.h"
#include "gateway/api/text_codec.h"
#include "gateway/structured/token_grammar.h"

namespace moe::gw {

struct HeldResponseBytes;

struct ApiOptions {
  std::string served_model_name = "demo-moe";
  std::vector<std::string> api_keys;  // any one of them opens every endpoint (priority 0, no rate limit)
  std::vector<ApiKeyEntry> keys;      // the keys file's (api_keys.h); no keys at all: no authentication
  bool allow_request_priority = false;  // the body's `priority` may set a request's priority
  bool experts_page = true;             // GET /experts and /experts.json (else 404)
  // Balancers whose X-Forwarded-For names the client (a keyless caller's address).
  std::vector<std::string> trusted_proxies;
  // Overload (docs/operations.md): past either bound (0: off) new requests
  // go to the fallback worker, or are refused with 429 without one.
  int overload_queue_depth = 0;
  uint64_t overload_wait_ms = 0;
  int max_choices = 128;              // prompts × n per request
  int64_t max_request_tokens = int64_t(1) << 20;   // RequestLimits
  int64_t max_logprob_entries = int64_t(1) << 18;  // RequestLimits
  size_t max_response_bytes = size_t(64) << 20;    // a whole response's text and logprobs
  size_t max_held_response_bytes = size_t(512) << 20;  // every whole response's together
  AdmissionLimits admission;
  SessionStore* sessions = nullptr;  // chat sessions by `session_id` / X-Session-Id (null: off)
  const PromptExpertPredictor* predictor = nullptr;  // /debug/experts (null: 404)
  // Worker name → its published resident set, for /debug/experts (may be unset).
  std::function<std::map<std::string, std::string>()> resident_sets;
  // Whether the Redis connection is up now (unset: no --redis). /health says
  // so, for whoever must not send session turns to a gateway that would keep
  // them in its memory alone (deploy/scale-out/hosts.sh waits on it).
  std::function<bool()> redis_connected;
};

class OpenAiApi final : public HttpHandler {
 public:
  // All pointers must outlive the API object.
  OpenAiApi(ApiOptions opts, Scheduler* scheduler, const TextCodec* codec, GatewayMetrics* metrics);

  void handle(const std::shared_ptr<HttpExchange>& ex) override;
  HttpResponse protocol_error(int status, const std::string& message) override;

  const Admission& admission() const { return admission_; }
  // The server whose connections /metrics reports (optional; set once it exists).
  // Also where a large response's freed memory is given back from (its loop's pool).
  void watch_server(const HttpServer* server);
  // Closes what watch_server() opened on the loop (its timer), beside the
  // server's close, so that the loop can end and be closed.
  void close();
  // Requests whose text is being tokenised on libuv's thread pool: the
  // process runs its loop until none is left before the codec goes.
  size_t jobs_in_flight() const { return jobs_in_flight_; }

 private:
  // Who sent a request: what admission counts and whose sessions it may read.
  struct Caller {
    std::string id;             // "key:<digest>" or "addr:<client address>"
    std::string session_owner;  // SessionKey::owner
    const ApiKeyEntry* key = nullptr;  // the key it called with (null: no keys configured)
  };

  // The body's JSON is read on the thread pool (a body of a megabyte takes
  // tens of milliseconds, which the loop would otherwise spend away from
  // every other connection), then completions_parsed() goes on, on the loop.
  void completions(ApiKind kind, const std::shared_ptr<HttpExchange>& ex, const Caller& caller);
  void completions_parsed(ApiKind kind, const std::shared_ptr<HttpExchange>& ex, const Caller& caller,
                          ParsedJson parsed);
  // After the session's stored turns (if any) were loaded.
  // `turn` (a session's turn): held until the turn ends, stored or not.
  // `body` is moved into the job (a copy of a large body's tree would cost
  // the loop as much as parsing it).
  void run_completion(ApiKind kind, const std::shared_ptr<HttpExchange>& ex, const Caller& caller,
                      nlohmann::json body, const SessionKey& session, ChatMessages prior,
                      std::shared_ptr<const void> turn = {});
  // A retried session turn whose answer is stored: that answer again, as
  // `req` (the retry, parsed and checked) asks for it (streamed or not).
  void replay(const std::shared_ptr<HttpExchange>& ex, const CompletionRequest& req, const SessionKey& session,
              const ChatMessage& stored);
  void models(const std::shared_ptr<HttpExchange>& ex, const std::string& path);
  void health(const std::shared_ptr<HttpExchange>& ex);
  // GET /experts (the page) and /experts.json (its data; marks the view watched).
  void experts_page(const std::shared_ptr<HttpExchange>& ex, bool page);
  void metrics(const std::shared_ptr<HttpExchange>& ex);
  void debug_experts(const std::shared_ptr<HttpExchange>& ex);
  void reply(const std::shared_ptr<HttpExchange>& ex, const std::string& endpoint, HttpResponse r);
  // Runs `work` on libuv's thread pool, so that tokenising a long prompt or
  // rendering a long chat holds up no other connection, then `then` on the
  // loop, unless the client has gone meanwhile. An exception in `work` is a
  // 500 for this request. `work` must touch nothing of this object: it
  // runs beside the loop. Without a server (no loop) both run here.
  // `caller` (Caller::id): once half the queue is taken, each caller may
  // hold only a few places in it with large bodies (a 429 past them). `admitted`: the
  // request's next step (a completion's tokenising after its JSON was
  // read): counted, never refused, since the request holds its place.
  void off_loop(const std::shared_ptr<HttpExchange>& ex, const char* endpoint, const std::string& caller,
                std::function<void()> work, std::function<void()> then, bool admitted = false);
  // off_loop for a reply `make` builds on the pool (/tokenize, /detokenize).
  void reply_off_loop(const std::shared_ptr<HttpExchange>& ex, const char* endpoint, const std::string& caller,
                      std::function<HttpResponse()> make);
  // A completion request from its parse on: what run_completion checked,
  // and the parse's inputs and result.
  struct CompletionJob {
    ApiKind kind = ApiKind::chat;
    std::shared_ptr<HttpExchange> ex;
    Caller caller;
    nlohmann::json body;
    SessionKey session;
    ChatMessages prior;
    std::shared_ptr<const void> turn;
    std::string request_key, request_digest;
    RequestLimits limits;  // the serving workers' when the parse began
    std::optional<ParsedRequest> parsed;
    std::optional<ChatMessage> replay_of;  // a retried turn's stored answer: checked, then replayed
  };
  RequestLimits limits_now() const;
  // Parses on the thread pool (off_loop), then start_completion; limits
  // that changed meanwhile parse it again, twice at most.
  void parse_then_start(std::shared_ptr<CompletionJob> job, int attempt);
  // A parsed body's tree, let go on the thread pool (from kFreeOffLoopBytes of body).
  void free_off_loop(nlohmann::json tree);
  static constexpr size_t kFreeOffLoopBytes = 256 * 1024;
  // A large response's freed memory is given back this long after the last one ended.
  static constexpr uint64_t kTrimAfterMs = 250;
  // run_completion's second half, on the loop once the request is parsed.
  void start_completion(CompletionJob& job);
  void reply_error(const std::shared_ptr<HttpExchange>& ex, const std::string& endpoint, const ApiError& e);
  // The error with Retry-After: retry_after_s (the server's state, not the request, refused it).
  void reply_retry_later(const std::shared_ptr<HttpExchange>& ex, const std::string& endpoint, const ApiError& e,
                         uint64_t retry_after_s);
  // The index of the key the request carries, -1 for none or a wrong one.
  // The key's index, or -1. `basic`: an HTTP Basic password counts too (the
  // experts page's browser login); elsewhere only a Bearer token does.
  int key_index(const HttpRequest& req, bool basic = false) const;
  std::string new_id(const char* prefix);

  ApiOptions opts_;
  std::vector<ApiKeyEntry> keys_;         // --api-key's and the keys file's, by digest
  std::vector<std::string> key_owners_;  // the session owner of each key (a digest of it)
  KeyRateLimiter rate_limiter_;
  uint64_t overload_fallback_ = 0, overload_refused_ = 0, rate_limited_ = 0, replayed_ = 0;
  Scheduler* scheduler_;
  const TextCodec* codec_;
  structured::GrammarRegistry grammars_;  // response_format: the vocabulary trie, grammars, masks
  GatewayMetrics* metrics_;
  Admission admission_;
  int64_t started_at_;  // unix seconds, the models' "created"
  std::mt19937_64 rng_;  // response ids and seeds of requests without one
  uint64_t next_request_serial_ = 1;
  const HttpServer* server_ = nullptr;
  size_t jobs_in_flight_ = 0;
  std::shared_ptr<HeldResponseBytes> held_responses_;  // every whole response's bytes (generation.h)
  struct Trimmer;
  Trimmer* trimmer_ = nullptr;  // the memory trim's timer (watch_server); freed by its close
  std::unordered_map<std::string, size_t> pool_jobs_by_caller_;  // off_loop's large jobs by Caller::id
  uint64_t pool_share_refused_ = 0;  // refused past a caller's share of the queue
  // Sessions with a turn running here (owner and id): a second turn of one
  // meanwhile is a 409, since each turn is answered from and saved over
  // the turns before it (two at once: one's turn lost, neither seeing the other).
  std::shared_ptr<std::unordered_set<std::string>> busy_sessions_ =
      std::make_shared<std::unordered_set<std::string>>();
};

}  // namespace moe::gw
