#pragma once
// One accepted completion request while it runs: a sequence per choice in
// the scheduler, a detokeniser and a stop-string matcher per choice, and the
// response, either streamed as Server-Sent Events chunk by chunk or built
// whole at the end.
//
// Lifetime: owned by its HttpExchange (HttpExchange::keep) so that it
// outlives its sequences; when the client goes away, every unfinished
// sequence is cancelled at once. A generation whose client left before it
// started is never kept (nothing would release it).
//
// Memory: a stream keeps no text or logprobs beyond what is being sent; a
// whole response counts what it holds against max_response_bytes.
// Threading: loop thread only (scheduler observers are called there).

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "gateway/admission.h"
#include "gateway/api/completion_request.h"
#include "gateway/http/http_server.h"
#include "gateway/metrics.h"
#include "gateway/sched/scheduler.h"
#include "gateway/api/reasoning_splitter.h"
#include "gateway/api/stop_matcher.h"
#include "gateway/api/tool_call_parser.h"
#include "gateway/api/text_codec.h"
#include "gateway/structured/token_grammar.h"

namespace moe::gw {

// What every whole response of the process holds together, against
// --max-held-response-bytes (loop thread only; shared so that a response
// may outlive the API object on shutdown).
struct HeldResponseBytes {
  size_t total = 0;
  size_t limit = size_t(512) << 20;
  uint64_t refused = 0;  // responses failed because the total was reached
  // Called once a response that held kTrimFromBytes or more is freed: the
  // allocator is asked to give its free memory back to the system (unset: not).
  std::function<void()> trim;
  bool trimming = false;  // one trim at a time
  static constexpr size_t kTrimFromBytes = size_t(4) << 20;
};

struct GenerationContext {
  Scheduler* scheduler = nullptr;
  const TextCodec* codec = nullptr;
  structured::GrammarRegistry* grammars = nullptr;  // response_format's grammars over the codec's vocabulary
  GatewayMetrics* metrics = nullptr;
  std::string endpoint;       // metrics label
  std::string response_id;    // "chatcmpl-…" / "cmpl-…"
  int64_t created = 0;        // unix seconds
  uint64_t start_ns = 0;      // uv_hrtime() when the request was accepted
  bool degraded = false;      // adds X-Moe-Degraded: 1
  uint64_t request_serial = 0;  // the scheduler starts sequences round-robin across these
  int priority = 0;             // SequenceRequest::priority (lower first)
  uint64_t caller = 0;          // SequenceRequest::caller (fair shares of the batch)
  bool on_fallback = false;     // overload: served by the fallback worker (SequenceRequest::on_fallback)
  // A whole (not streamed) response may hold at most this many bytes of
  // text and logprobs; past it the request fails with 400 response_too_large.
  size_t max_response_bytes = size_t(64) << 20;
  // Every whole response together (null: unbounded); past it the response
  // that grows fails with 503 responses_memory_full.
  std::shared_ptr<HeldResponseBytes> held_total;
  AdmissionTicket ticket;     // released when the response is over
  // Sessions: headers added to the response, and choice 0's text once the
  // response completed (not after an error or a disconnect). The response's
  // end (the whole body, or a stream's last events) waits until on_complete
  // calls `then`: the turn is stored before the client can send the next.
  HttpHeaders extra_headers;
  std::function<void(const ChatMessage& reply, std::function<void()> then)> on_complete;
};

class Generation : public std::enable_shared_from_this<Generation> {
 public:
  Generation(GenerationContext ctx, CompletionRequest req, std::shared_ptr<HttpExchange> ex);
  ~Generation();

  // Generations alive in this process (the /metrics gauge that shows a leak).
  static size_t live();

  // Submits every choice's sequence and, for a stream, sends the head and
  // the first (role) chunks. `seed` is choice 0's seed.
  void start(uint64_t seed);

 private:
  struct Choice final : SequenceObserver {
    Generation* gen = nullptr;
    int index = 0;   // in the response; with best_of above n, the candidate's until complete() ranks them
    int prompt = 0;  // which of the request's prompts
    uint64_t seq = 0;
    bool submitted = false;
    bool done = false;
    std::unique_ptr<TokenTextStream> decoder;
    StopMatcher matcher{{}};
    std::string text;             // shown so far (a stream keeps it only for a session)
    // A thinking model's chat: its reasoning apart from the answer.
    std::optional<ReasoningSplitter> splitter;
    std::string reasoning;        // a whole response's reasoning_content
    size_t text_bytes = 0;        // bytes of text shown so far
    size_t text_chars = 0;        // its characters (code points)
    // Characters the decoder has given so far, shown or held back (a
    // possible stop string, part of a character): where the next token's
    // text starts, its text_offset.
    size_t decoded_chars = 0;
    int tokens = 0;               // generated, stop ids included
    uint64_t last_token_ns = 0;
    std::string finish_reason;
    // A whole response's entries; a stream's whose token's text is not
    // shown yet (held back as a possible stop string, or part of a
    // character): sent with it, or dropped with a matched stop string, as a
    // whole response drops them.
    nlohmann::json logprobs;
    std::vector<size_t> logprob_offsets;  // each entry's text_offset (chat's too), to cut a stop string's
    int cached_prompt_tokens = 0;  // of its prompt, what the worker's prefix cache served
    double logprob_sum = 0;       // best_of: log probabilities of the generated tokens (stop ids aside)
    int logprob_count = 0;
    // Tools: the answer's text parsed for tool calls (tool_choice other than none).
    std::optional<ToolCallParser> tool_parser;
    nlohmann::json tool_calls = nlohmann::json::array();  // made so far, in the response's shape

    // An exception from the text side (a bug) fails this request with a
    // 500, never the process.
    void on_token(const TokenEvent& ev) override;
    void on_finished(FinishReason r, const std::string& msg) override;
  };

  void begin(uint64_t seed);  // start()'s work; an exception fails the request
  void token(Choice& c, const TokenEvent& ev);
  void finished(Choice& c, FinishReason reason, const std::string& message);
  // `tail_logprobs`: a stream's last entries, sent with the tail.
  void finish_choice(Choice& c, const char* reason, const std::string& tail_text,
                     const nlohmann::json* tail_logprobs = nullptr);
  // A stream's held entries (Choice::logprobs) whose text is shown now
  // (offset before text_chars), or all of them; null when none.
  nlohmann::json take_stream_logprobs(Choice& c, bool all) const;
  void complete();
  void finish_response();  // the rest of complete(), once the turn is stored
  void fail(const std::string& message);
  void fail(const ApiError& error);
  // Ends the request after an exception escaped the text side.
  void internal_failure(const char* what) noexcept;
  // Counts bytes a whole response will hold; false (and the request failed)
  // past max_response_bytes.
  bool hold(size_t bytes);
  void abort();
  void cancel_running();

  // Logprob entries of one token, in the endpoint's shape, appended to `into`.
  void add_logprobs(const TokenEvent& ev, size_t text_offset, nlohmann::json& into) const;
  nlohmann::json empty_logprobs() const;
  // One SSE event with one choice.
  void send_chunk(const Choice& c, const std::string& text, const nlohmann::json* logprobs, const char* finish,
                  bool with_role);
  // A chat chunk of reasoning: delta {"reasoning_content": text}.
  void send_reasoning_chunk(const Choice& c, const std::string& text, const nlohmann::json* logprobs);
  // A whole response cut by a stop string: its tokens' logprobs go with it.
  void drop_stop_logprobs(Choice& c) const;
  // Text the matcher let through, split into reasoning (sent or kept) and
  // the answer it returns; `last` at the end of the output.
  // `logprobs` (a stream's, of this token) go with the reasoning chunk when
  // the token showed no answer text before the answer began; *sent says so.
  std::string route_text(Choice& c, const std::string& text, bool last, const nlohmann::json* logprobs,
                         bool* sent = nullptr);
  void send_event(const nlohmann::json& payload);
  // Tools: the answer text through the choice's parser (its content back);
  // each call made is kept, and in a stream sent as a tool_calls delta.
  std::string tool_text(Choice& c, const std::string& text, bool last);
  void send_tool_chunk(const Choice& c, const nlohmann::json& call);
  std::string tool_call_id(int choice, size_t k) const;
  nlohmann::json usage() const;
  bool is_stop_id(int32_t id) const;
  // Candidates a prompt: best_of when above n.
  int candidates() const { return std::max(req_.n, req_.best_of); }
  // Prompt p as text (echo).
  std::string prompt_text(int p) const;

  GenerationContext ctx_;
  CompletionRequest req_;
  std::shared_ptr<HttpExchange> ex_;
  std::vector<int32_t> stop_ids_;
  std::vector<std::unique_ptr<Choice>> choices_;
  std::vector<std::string> echo_texts_;  // echo: each prompt's text
  int finished_ = 0;
  bool over_ = false;  // response ended (completed, failed or aborted)
  size_t held_bytes_ = 0;  // text and logprobs a whole response holds so far
  size_t peak_held_ = 0;   // the most it held
  // Gives held_bytes_ back to ctx_.held_total (on failure, on leaving, at the end).
  void release_held();
};

}  // namespace moe::gw
