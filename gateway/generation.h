#pragma once
// One accepted completion request while it runs: a sequence per choice in
// the scheduler, a detokeniser and a stop-string matcher per choice, and the
// response, either streamed as Server-Sent Events chunk by chunk or built
// whole at the end.
//
// Lifetime: owned by its HttpExchange (HttpExchange::keep) so that it
// outlives its sequences; when the client goes away, every unfinished
// sequence is cancelled at once.
// Threading: loop thread only (scheduler observers are called there).

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "gateway/completion_request.h"
#include "gateway/http_server.h"
#include "gateway/metrics.h"
#include "gateway/scheduler.h"
#include "gateway/stop_matcher.h"
#include "gateway/text_codec.h"

namespace moe::gw {

struct GenerationContext {
  Scheduler* scheduler = nullptr;
  const TextCodec* codec = nullptr;
  GatewayMetrics* metrics = nullptr;
  std::string endpoint;       // metrics label
  std::string response_id;    // "chatcmpl-…" / "cmpl-…"
  int64_t created = 0;        // unix seconds
  uint64_t start_ns = 0;      // uv_hrtime() when the request was accepted
  bool degraded = false;      // adds X-Moe-Degraded: 1
  // Sessions: headers added to the response, and choice 0's text once the
  // response completed (not after an error or a disconnect).
  HttpHeaders extra_headers;
  std::function<void(const std::string& text)> on_complete;
};

class Generation : public std::enable_shared_from_this<Generation> {
 public:
  Generation(GenerationContext ctx, CompletionRequest req, std::shared_ptr<HttpExchange> ex);
  ~Generation();

  // Submits every choice's sequence and, for a stream, sends the head and
  // the first (role) chunks. `seed` is choice 0's seed.
  void start(uint64_t seed);

 private:
  struct Choice final : SequenceObserver {
    Generation* gen = nullptr;
    int index = 0;
    uint64_t seq = 0;
    bool submitted = false;
    bool done = false;
    std::unique_ptr<TokenTextStream> decoder;
    StopMatcher matcher{{}};
    std::string text;             // shown so far
    int tokens = 0;               // generated, stop ids included
    uint64_t last_token_ns = 0;
    std::string finish_reason;
    nlohmann::json logprobs;      // accumulated for a whole response

    void on_token(const TokenEvent& ev) override { gen->token(*this, ev); }
    void on_finished(FinishReason r, const std::string& msg) override { gen->finished(*this, r, msg); }
  };

  void token(Choice& c, const TokenEvent& ev);
  void finished(Choice& c, FinishReason reason, const std::string& message);
  void finish_choice(Choice& c, const char* reason, const std::string& tail_text);
  void complete();
  void fail(const std::string& message);
  void abort();
  void cancel_running();

  // Logprob entries of one token, in the endpoint's shape, appended to `into`.
  void add_logprobs(const TokenEvent& ev, size_t text_offset, nlohmann::json& into) const;
  nlohmann::json empty_logprobs() const;
  // One SSE event with one choice.
  void send_chunk(const Choice& c, const std::string& text, const nlohmann::json* logprobs, const char* finish,
                  bool with_role);
  void send_event(const nlohmann::json& payload);
  nlohmann::json usage() const;
  bool is_stop_id(int32_t id) const;

  GenerationContext ctx_;
  CompletionRequest req_;
  std::shared_ptr<HttpExchange> ex_;
  std::vector<int32_t> stop_ids_;
  std::vector<std::unique_ptr<Choice>> choices_;
  int finished_ = 0;
  bool over_ = false;  // response ended (completed, failed or aborted)
};

}  // namespace moe::gw
