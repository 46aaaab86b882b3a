#include "gateway/api/generation.h"

#include <algorithm>
#include <atomic>
#include <cstdio>

#include <uv.h>

#include "gateway/json_body.h"
#include "gateway/last_resort.h"
#include "tokenizer/utf8.h"

namespace moe::gw {
namespace {

// Characters of UTF-8 text (the bytes that start one): completions'
// text_offset counts them, as a client indexing the text does.
size_t code_points(const std::string& s) {
  size_t n = 0;
  for (unsigned char b : s) n += (b & 0xC0) != 0x80;
  return n;
}

using json = nlohmann::json;

// Token text may be part of a UTF-8 character; invalid bytes become U+FFFD.
std::string dump(const json& j) { return json_text(j); }

// What a logprob entry of a whole response costs in memory: its JSON nodes
// and, at the end, its share of the response's text. Measured with glibc's
// allocator on nlohmann::json trees shaped as add_logprobs makes them
// (12,416 entries): chat 640 + 540 a alternative in the tree and 75 + 60 in
// the text (an alternative is an object with a bytes array); completions
// 115 + 100 and 20 + 17 (an alternative is one key). Counting less let one
// request within every limit (n 128, top_logprobs 20, 97 tokens) hold ~400
// MB against a 64 MiB limit.
size_t logprob_entry_bytes(ApiKind kind, int alternatives) {
  const size_t k = size_t(std::max(alternatives, 0));
  return kind == ApiKind::chat ? 720 + k * 600 : 160 + k * 128;
}

json bytes_array(const std::string& s) {
  json a = json::array();
  for (unsigned char c : s) a.push_back(static_cast<int>(c));
  return a;
}

// A completions logprob token as text: itself, or where it is part of a
// character, "bytes:" and its bytes as \xNN (distinct tokens stay distinct
// keys of top_logprobs, where they all read U+FFFD).
std::string completion_token_text(const TextCodec& codec, int32_t id) {
  const std::string raw = codec.token_raw_bytes(id);
  if (moe::tok::utf8_valid(raw)) return codec.token_bytes(id);
  std::string out = "bytes:";
  char hex[5];
  for (unsigned char c : raw) {
    std::snprintf(hex, sizeof hex, "\\x%02x", c);
    out += hex;
  }
  return out;
}

}  // namespace

namespace {
std::atomic<size_t> g_live_generations{0};
}  // namespace

Generation::Generation(GenerationContext ctx, CompletionRequest req, std::shared_ptr<HttpExchange> ex)
    : ctx_(std::move(ctx)), req_(std::move(req)), ex_(std::move(ex)) {
  // The model's end ids (unless ignore_eos) and the request's own.
  if (!req_.ignore_eos) stop_ids_ = ctx_.codec->stop_token_ids();
  for (int32_t id : req_.stop_token_ids)
    if (std::find(stop_ids_.begin(), stop_ids_.end(), id) == stop_ids_.end()) stop_ids_.push_back(id);
  g_live_generations.fetch_add(1, std::memory_order_relaxed);
}

Generation::~Generation() {
  g_live_generations.fetch_sub(1, std::memory_order_relaxed);
  release_held();
  // (its choices are freed after this body; the trim waits for a timer)
  if (ctx_.held_total && ctx_.held_total->trim && peak_held_ >= HeldResponseBytes::kTrimFromBytes)
    last_resort("a response's memory given back", ctx_.held_total->trim);
}

void Generation::release_held() {
  if (ctx_.held_total) ctx_.held_total->total -= held_bytes_;
  held_bytes_ = 0;
}

size_t Generation::live() { return g_live_generations.load(std::memory_order_relaxed); }

bool Generation::is_stop_id(int32_t id) const {
  return std::find(stop_ids_.begin(), stop_ids_.end(), id) != stop_ids_.end();
}

json Generation::empty_logprobs() const {
  if (req_.kind == ApiKind::chat) return json{{"content", json::array()}};
  return json{{"tokens", json::array()},
              {"token_logprobs", json::array()},
              {"top_logprobs", json::array()},
              {"text_offset", json::array()}};
}

void Generation::add_logprobs(const TokenEvent& ev, size_t text_offset, json& into) const {
  const TextCodec& codec = *ctx_.codec;
  if (req_.kind == ApiKind::chat) {
    // "token" is text (U+FFFD for part of a character); "bytes" the token's own.
    json top = json::array();
    for (const auto& [id, lp] : ev.top)
      top.push_back({{"token", codec.token_bytes(id)}, {"logprob", lp}, {"bytes", bytes_array(codec.token_raw_bytes(id))}});
    into["content"].push_back({{"token", codec.token_bytes(ev.token)},
                               {"logprob", ev.logprob},
                               {"bytes", bytes_array(codec.token_raw_bytes(ev.token))},
                               {"top_logprobs", top}});
  } else {
    json top = json::object();
    for (const auto& [id, lp] : ev.top) top[completion_token_text(codec, id)] = lp;
    into["tokens"].push_back(completion_token_text(codec, ev.token));
    into["token_logprobs"].push_back(ev.logprob);
    into["top_logprobs"].push_back(top);
    into["text_offset"].push_back(text_offset);
  }
}

void Generation::Choice::on_token(const TokenEvent& ev) {
  Generation* g = gen;
  if (!last_resort("a token's text", [&] { g->token(*this, ev); })) g->internal_failure("a token's text");
}

void Generation::Choice::on_finished(FinishReason r, const std::string& msg) {
  Generation* g = gen;
  if (!last_resort("a sequence's end", [&] { g->finished(*this, r, msg); })) g->internal_failure("a sequence's end");
}

void Generation::internal_failure(const char* what) noexcept {
  // Whatever state the failure left (the response may have been over
  // already, half built), the client is told and nothing runs on.
  over_ = true;
  ctx_.ticket.release();
  last_resort(what, [&] { cancel_running(); });
  const ApiError err{500, "Internal error while producing the response.", "server_error", "", "internal_error"};
  const bool told = last_resort(what, [&] {
    if (!ex_->open()) return;
    if (req_.stream) {
      ex_->send("data: " + api_error_json(err) + "\n\n");
      ex_->send("data: [DONE]\n\n");
      ex_->end();
    } else {
      ctx_.metrics->count_request(ctx_.endpoint, 500);
      ex_->respond(api_error_response(err));
    }
  });
  // Not even that: the stream (or what was begun of the response) is ended.
  if (!told) last_resort(what, [&] { ex_->end(); });
}

bool Generation::hold(size_t bytes) {
  if (req_.stream) return true;
  if (over_) return false;  // failed or left: nothing more is kept
  if (held_bytes_ + bytes > ctx_.max_response_bytes) {
    fail(ApiError{400,
                  "The response grew past the server's limit of " + std::to_string(ctx_.max_response_bytes) +
                      " bytes; ask for fewer tokens, choices or logprobs, or stream it.",
                  "invalid_request_error", "", "response_too_large"});
    return false;
  }
  if (HeldResponseBytes* all = ctx_.held_total.get()) {
    if (all->total + bytes > all->limit) {
      ++all->refused;
      ApiError e{503,
                 "The server holds as many whole responses as its memory allows (" + std::to_string(all->limit) +
                     " bytes together); retry shortly, or stream the response.",
                 "server_error", "", "responses_memory_full"};
      fail(e);
      return false;
    }
    all->total += bytes;
  }
  held_bytes_ += bytes;
  peak_held_ = std::max(peak_held_, held_bytes_);
  return true;
}

void Generation::start(uint64_t seed) {
  if (!last_resort("starting a request", [&] { begin(seed); })) internal_failure("starting a request");
}

void Generation::begin(uint64_t seed) {
  // A client gone before we started: nothing would ever release a kept
  // generation (it and its exchange would hold each other).
  if (!ex_->open()) {
    over_ = true;
    ctx_.ticket.release();
    ctx_.metrics->count_disconnect();
    return;
  }
  ex_->keep(shared_from_this());
  ex_->on_abort([this] { abort(); });
  if (req_.stream) {
    HttpHeaders h = {{"Content-Type", "text/event-stream"}, {"Cache-Control", "no-cache"}};
    if (ctx_.degraded) h.emplace_back("X-Moe-Degraded", "1");
    h.insert(h.end(), ctx_.extra_headers.begin(), ctx_.extra_headers.end());
    ex_->begin_stream(200, std::move(h));
    ctx_.metrics->count_request(ctx_.endpoint, 200);
  }
  int n_prompts = static_cast<int>(req_.prompts.size());
  for (int p = 0; p < n_prompts; ++p) {
    ctx_.metrics->add_prompt_tokens(req_.prompts[p].size());
    for (int i = 0; i < candidates(); ++i) {
      auto c = std::make_unique<Choice>();
      c->gen = this;
      c->index = p * candidates() + i;
      c->prompt = p;
      c->decoder = ctx_.codec->stream_decoder();
      c->matcher = StopMatcher(req_.stop);
      c->logprobs = empty_logprobs();
      if (req_.kind == ApiKind::chat) {
        const TextCodec::ReasoningTags tags = ctx_.codec->reasoning_tags();
        if (!tags.open.empty() && !tags.close.empty()) {
          // Did the prompt itself open the reasoning (the template's generation prompt)?
          const std::vector<int32_t>& prompt = req_.prompts[static_cast<size_t>(p)];
          std::string tail;
          for (size_t k = prompt.size() > 8 ? prompt.size() - 8 : 0; k < prompt.size(); ++k)
            tail += ctx_.codec->token_bytes(prompt[k]);
          while (!tail.empty() && (tail.back() == '\n' || tail.back() == ' ' || tail.back() == '\r')) tail.pop_back();
          const bool inside = tail.size() >= tags.open.size() &&
                              tail.compare(tail.size() - tags.open.size(), tags.open.size(), tags.open) == 0;
          c->splitter.emplace(tags.open, tags.close, inside);
        }
      }
      if (req_.kind == ApiKind::chat && req_.tool_choice != CompletionRequest::ToolChoice::none)
        c->tool_parser.emplace(ctx_.codec->tool_format() == TextCodec::ToolFormat::mistral
                                   ? ToolCallParser::Markup::mistral
                                   : ToolCallParser::Markup::hermes);
      choices_.push_back(std::move(c));
    }
  }
  if (req_.stream && req_.kind == ApiKind::chat) {
    for (const auto& c : choices_) send_chunk(*c, "", nullptr, nullptr, true);
  }
  if (req_.echo)  // each prompt's text once, for all its choices
    for (int p = 0; p < n_prompts; ++p) echo_texts_.push_back(prompt_text(p));
  if (req_.stream && req_.echo) {
    for (const auto& c : choices_) send_chunk(*c, echo_texts_[size_t(c->prompt)], nullptr, nullptr, false);
  }
  for (auto& c : choices_) {
    SequenceRequest sr;
    sr.prompt = req_.prompts[size_t(c->prompt)];
    sr.max_new_tokens = req_.max_new_tokens;
    sr.sampling = req_.sampling;
    if (req_.best_of > req_.n) sr.sampling.logprobs = true;  // to rank the candidates
    sr.sampling.seed = seed + static_cast<uint64_t>(c->index);
    sr.stop_ids = stop_ids_;
    sr.logit_bias = req_.logit_bias;
    sr.min_tokens = req_.min_tokens;
    if (req_.response_schema && ctx_.grammars) sr.grammar = ctx_.grammars->grammar(req_.response_schema);
    sr.group = ctx_.request_serial;
    sr.priority = ctx_.priority;
    sr.caller = ctx_.caller;
    sr.on_fallback = ctx_.on_fallback;
    c->last_token_ns = ctx_.start_ns;
    c->seq = ctx_.scheduler->submit(std::move(sr), c.get());
    c->submitted = true;
    if (over_) return;  // the client left while we submitted
  }
}

void Generation::token(Choice& c, const TokenEvent& ev) {
  if (c.done || over_) return;
  uint64_t now = uv_hrtime();
  double since = static_cast<double>(now - c.last_token_ns) * 1e-9;
  if (c.tokens == 0) {
    ctx_.metrics->observe_ttft(since);
    c.cached_prompt_tokens = ev.cached_prompt_tokens;
    ctx_.metrics->add_cached_prompt_tokens(uint64_t(std::max(ev.cached_prompt_tokens, 0)));
  } else {
    ctx_.metrics->observe_itl(since);
  }
  c.last_token_ns = now;
  ++c.tokens;
  ctx_.metrics->add_completion_tokens(1);

  json chunk_logprobs;
  bool stop_id = is_stop_id(ev.token);
  if (!stop_id) {
    c.logprob_sum += ev.logprob;
    ++c.logprob_count;
  }
  // The token's text starts after everything decoded before it, whether
  // shown yet or held back (a possible stop string, part of a character).
  const size_t offset = c.decoded_chars;
  if (req_.sampling.logprobs && !stop_id) {
    // A whole response keeps every entry; a stream, until its text shows.
    if (!req_.stream && !hold(logprob_entry_bytes(req_.kind, req_.sampling.top_logprobs))) return;
    add_logprobs(ev, offset, c.logprobs);
    c.logprob_offsets.push_back(offset);
  }
  std::string piece = stop_id ? std::string() : c.decoder->push(ev.token);
  c.decoded_chars += code_points(piece);
  // Stop strings count from the min_tokens-th token on (the text before it
  // passes the matcher unseen, as the stop ids are banned until then).
  StopMatcher::Step step = c.tokens <= req_.min_tokens ? StopMatcher::Step{piece, false} : c.matcher.push(piece);
  if (!hold(step.text.size())) return;
  c.text_bytes += step.text.size();
  c.text_chars += code_points(step.text);
  // A stream's entries go out with their text (a matched stop string's
  // tokens never show: theirs are dropped below).
  if (req_.stream) chunk_logprobs = take_stream_logprobs(c, false);
  const json* lp = chunk_logprobs.is_null() ? nullptr : &chunk_logprobs;
  bool lp_sent = false;
  const std::string answer = tool_text(c, route_text(c, step.text, step.stopped, lp, &lp_sent), step.stopped);
  if (lp_sent) lp = nullptr;  // sent with the reasoning
  // A stream sends its text as it goes and keeps only what a session stores.
  if (!req_.stream || (ctx_.on_complete && c.index == 0)) c.text += answer;
  if (step.stopped) {
    ctx_.scheduler->cancel(c.seq);
    if (!req_.stream) drop_stop_logprobs(c);
    if (req_.stream && lp) send_chunk(c, answer, lp, nullptr, false);
    finish_choice(c, "stop", req_.stream && lp ? std::string() : answer);
    return;
  }
  if (req_.stream && (!answer.empty() || lp)) send_chunk(c, answer, lp, nullptr, false);
}

void Generation::drop_stop_logprobs(Choice& c) const {
  // The tokens that made the matched stop string: their text starts at or
  // after the end of the text the response keeps (a token that straddles
  // the cut shows in part, and keeps its entry).
  size_t drop = 0;
  while (drop < c.logprob_offsets.size() && c.logprob_offsets[c.logprob_offsets.size() - 1 - drop] >= c.text_chars)
    ++drop;
  if (drop == 0 || c.logprobs.is_null()) return;
  for (auto& [key, list] : c.logprobs.items())
    if (list.is_array() && list.size() >= drop) list.erase(list.end() - std::ptrdiff_t(drop), list.end());
  c.logprob_offsets.resize(c.logprob_offsets.size() - drop);
}

std::string Generation::route_text(Choice& c, const std::string& text, bool last, const json* logprobs, bool* sent) {
  if (sent) *sent = false;
  if (!c.splitter) return text;
  const bool was_answer = c.splitter->in_content();
  ReasoningSplitter::Parts parts = c.splitter->push(text);
  if (last) {
    ReasoningSplitter::Parts rest = c.splitter->finish();
    parts.reasoning += rest.reasoning;
    parts.content += rest.content;
  }
  if (!req_.stream) {
    c.reasoning += parts.reasoning;
    return parts.content;
  }
  // A token of the reasoning (or one that showed nothing before the answer
  // began) carries its logprobs on the reasoning chunk; an answer token's
  // stay with the answer.
  const bool lp_here = logprobs && parts.content.empty() && !was_answer;
  if (!parts.reasoning.empty() || lp_here) send_reasoning_chunk(c, parts.reasoning, lp_here ? logprobs : nullptr);
  if (sent) *sent = lp_here;
  return parts.content;
}

void Generation::finished(Choice& c, FinishReason reason, const std::string& message) {
  if (c.done || over_) return;
  if (reason == FinishReason::error || reason == FinishReason::cancelled) {
    c.done = true;
    fail(message.empty() ? std::string("the engine ended the sequence") : message);
    return;
  }
  StopMatcher::Step step = c.matcher.push(c.decoder->flush());
  std::string tail = step.text + c.matcher.finish();
  if (!hold(tail.size())) return;
  c.text_bytes += tail.size();
  c.text_chars += code_points(tail);
  tail = tool_text(c, route_text(c, tail, true, nullptr), true);
  if (!req_.stream || (ctx_.on_complete && c.index == 0)) c.text += tail;
  if (!req_.stream && step.stopped) drop_stop_logprobs(c);
  // A stream's held entries: with the tail, but a matched stop string's.
  const json tail_logprobs = req_.stream ? take_stream_logprobs(c, !step.stopped) : json();
  finish_choice(c, step.stopped || reason == FinishReason::stop ? "stop" : "length", tail,
                tail_logprobs.is_null() ? nullptr : &tail_logprobs);
}

json Generation::take_stream_logprobs(Choice& c, bool all) const {
  size_t n = 0;
  while (n < c.logprob_offsets.size() && (all || c.logprob_offsets[n] < c.text_chars)) ++n;
  if (n == 0) return json();
  json out = empty_logprobs();
  for (auto& [key, list] : c.logprobs.items()) {
    if (!list.is_array() || list.size() < n) continue;
    json& dst = out[key];
    for (size_t i = 0; i < n; ++i) dst.push_back(std::move(list[i]));
    list.erase(list.begin(), list.begin() + std::ptrdiff_t(n));
  }
  c.logprob_offsets.erase(c.logprob_offsets.begin(), c.logprob_offsets.begin() + std::ptrdiff_t(n));
  return out;
}

void Generation::finish_choice(Choice& c, const char* reason, const std::string& tail_text,
                               const json* tail_logprobs) {
  c.done = true;
  // A turn that ended after calling tools (not cut by max_tokens) asks for their results.
  if (!c.tool_calls.empty() && std::string(reason) == "stop") reason = "tool_calls";
  c.finish_reason = reason;
  if (req_.stream) {
    if (!tail_text.empty() || tail_logprobs) send_chunk(c, tail_text, tail_logprobs, nullptr, false);
    if (over_) return;
    send_chunk(c, "", nullptr, reason, false);
    if (over_) return;
  }
  if (++finished_ == static_cast<int>(choices_.size())) complete();
}

std::string Generation::prompt_text(int p) const {
  std::unique_ptr<TokenTextStream> d = ctx_.codec->stream_decoder();
  std::string text;
  for (int32_t id : req_.prompts[size_t(p)]) text += d->push(id);
  return text + d->flush();
}

json Generation::usage() const {
  int64_t prompt = 0, completion = 0;
  for (const auto& p : req_.prompts) prompt += static_cast<int64_t>(p.size());
  for (const auto& c : choices_) completion += c->tokens;
  json u = {{"prompt_tokens", prompt}, {"completion_tokens", completion}, {"total_tokens", prompt + completion}};
  // Of each prompt, what its first choice found in the worker's prefix cache.
  int64_t cached = 0;
  std::vector<bool> counted(req_.prompts.size(), false);
  for (const auto& c : choices_)  // in the order they were made: each prompt's first candidate first
    if (!counted[size_t(c->prompt)]) {
      counted[size_t(c->prompt)] = true;
      cached += c->cached_prompt_tokens;
    }
  u["prompt_tokens_details"] = {{"cached_tokens", cached}};
  // What the context policy left out of the prompt (docs/gateway.md).
  if (req_.trimmed_messages > 0 || req_.trimmed_tokens > 0)
    u["prompt_trimmed"] = {{"messages", req_.trimmed_messages}, {"tokens", req_.trimmed_tokens}};
  return u;
}

void Generation::complete() {
  over_ = true;
  ctx_.ticket.release();
  if (ctx_.degraded) ctx_.metrics->count_degraded_response();
  if (ctx_.on_complete && !choices_.empty()) {
    const Choice& c0 = *choices_[0];
    ChatMessage reply{"assistant", c0.text, c0.tool_calls.empty() ? std::string() : c0.tool_calls.dump(), ""};
    reply.finish_reason = c0.finish_reason;
    reply.response_id = ctx_.response_id;
    reply.created = ctx_.created;
    reply.usage = json_text(usage());
    // The session's store answers first (a next turn sent to another host
    // must find this one), then the response ends.
    ctx_.on_complete(reply, [self = shared_from_this()] {
      // Run from the store's Redis reply: a failure is still this response's.
      if (!last_resort("a response's end", [&] { self->finish_response(); })) self->internal_failure("a response's end");
    });
    return;
  }
  finish_response();
}

void Generation::finish_response() {
  if (req_.stream) {
    if (req_.include_usage) {
      json u = {{"id", ctx_.response_id},
                {"object", req_.kind == ApiKind::chat ? "chat.completion.chunk" : "text_completion"},
                {"created", ctx_.created},
                {"model", req_.model},
                {"choices", json::array()},
                {"usage", usage()}};
      send_event(u);
    }
    ex_->send("data: [DONE]\n\n");
    ex_->end();
    return;
  }
  // best_of: per prompt the n candidates of the highest log probability a
  // token (the earlier among equals), renumbered in that order.
  std::vector<Choice*> shown;
  for (const auto& c : choices_) shown.push_back(c.get());
  if (candidates() > req_.n) {
    auto mean = [](const Choice* c) { return c->logprob_count ? c->logprob_sum / c->logprob_count : -1e300; };
    std::stable_sort(shown.begin(), shown.end(), [&](const Choice* a, const Choice* b) {
      return a->prompt != b->prompt ? a->prompt < b->prompt : mean(a) > mean(b);
    });
    std::vector<Choice*> kept;
    std::vector<int> taken(req_.prompts.size(), 0);
    for (Choice* c : shown)
      if (taken[size_t(c->prompt)] < req_.n) {
        c->index = c->prompt * req_.n + taken[size_t(c->prompt)]++;
        kept.push_back(c);
      }
    shown = std::move(kept);
  }
  json choices = json::array();
  for (const Choice* c : shown) {
    json lp = req_.sampling.logprobs ? c->logprobs : json(nullptr);
    if (req_.kind == ApiKind::chat) {
      std::string content = c->text, reasoning = c->reasoning;
      // Not under a grammar (response_format, a forced tool call): the whole
      // text is the value it asked for, whatever it holds (a string
      // "a</think>b" was cut in two, and the JSON with it).
      if (c->splitter && !c->splitter->entered() && !req_.response_schema) {
        // A close tag without an open one (models whose template does not
        // open the reasoning): the text before it was reasoning.
        const std::string close = ctx_.codec->reasoning_tags().close;
        if (const size_t at = content.find(close); at != std::string::npos) {
          reasoning = content.substr(0, at);
          size_t b = at + close.size();
          while (b < content.size() && (content[b] == '\n' || content[b] == ' ' || content[b] == '\r')) ++b;
          content = content.substr(b);
        }
      }
      json message = {{"role", "assistant"}, {"content", content}};
      if (!c->tool_calls.empty()) {
        message["tool_calls"] = c->tool_calls;
        // Only whitespace around the calls: no content.
        if (content.find_first_not_of(" \n\r\t") == std::string::npos) message["content"] = nullptr;
      }
      // The key only where the model reasoned (a template may mention </think>
      // only to strip it from past turns).
      if (c->splitter && (c->splitter->entered() || !reasoning.empty())) message["reasoning_content"] = reasoning;
      choices.push_back({{"index", c->index}, {"message", message}, {"logprobs", lp}, {"finish_reason", c->finish_reason}});
    } else {
      choices.push_back({{"index", c->index},
                         {"text", req_.echo ? echo_texts_[size_t(c->prompt)] + c->text : c->text},
                         {"logprobs", lp},
                         {"finish_reason", c->finish_reason}});
    }
  }
  json body = {{"id", ctx_.response_id},
               {"object", req_.kind == ApiKind::chat ? "chat.completion" : "text_completion"},
               {"created", ctx_.created},
               {"model", req_.model},
               {"choices", choices},
               {"usage", usage()}};
  HttpResponse r;
  r.headers = {{"Content-Type", "application/json"}};
  if (ctx_.degraded) r.headers.emplace_back("X-Moe-Degraded", "1");
  r.headers.insert(r.headers.end(), ctx_.extra_headers.begin(), ctx_.extra_headers.end());
  r.body = dump(body);
  ctx_.metrics->count_request(ctx_.endpoint, 200);
  ex_->respond(std::move(r));
}

void Generation::cancel_running() {
  for (auto& c : choices_) {
    if (!c->done) {
      c->done = true;
      if (c->submitted) ctx_.scheduler->cancel(c->seq);
    }
  }
}

void Generation::fail(const std::string& message) { fail(ApiError{500, message, "server_error", "", "engine_error"}); }

void Generation::fail(const ApiError& err) {
  if (over_) return;
  over_ = true;
  ctx_.ticket.release();
  release_held();  // what it held goes with its answer: no other response waits on it
  cancel_running();
  if (req_.stream) {
    ex_->send("data: " + api_error_json(err) + "\n\n");
    ex_->send("data: [DONE]\n\n");
    ex_->end();
    return;
  }
  ctx_.metrics->count_request(ctx_.endpoint, err.status);
  HttpResponse r = api_error_response(err);
  if (err.status == 503) r.headers.emplace_back("Retry-After", "1");  // the server's state, not the request
  ex_->respond(std::move(r));
}

void Generation::abort() {
  if (over_) return;
  over_ = true;
  ctx_.ticket.release();
  release_held();
  ctx_.metrics->count_disconnect();
  cancel_running();
}

std::string Generation::tool_text(Choice& c, const std::string& text, bool last) {
  if (!c.tool_parser) return text;
  ToolCallParser::Step step = c.tool_parser->push(text);
  if (last) {
    ToolCallParser::Step rest = c.tool_parser->finish();
    step.text += rest.text;
    step.calls.insert(step.calls.end(), rest.calls.begin(), rest.calls.end());
  }
  for (ToolCallParser::Call& call : step.calls) {
    // parallel_tool_calls false: the first call only.
    if (!req_.parallel_tool_calls && !c.tool_calls.empty()) break;
    json entry = {{"id", tool_call_id(c.index, c.tool_calls.size())},
                  {"type", "function"},
                  {"function", {{"name", std::move(call.name)}, {"arguments", std::move(call.arguments)}}}};
    if (req_.stream) send_tool_chunk(c, entry);
    c.tool_calls.push_back(std::move(entry));
  }
  return step.text;
}

std::string Generation::tool_call_id(int choice, size_t k) const {
  // Mistral's templates take ids of nine letters and digits; others call_….
  const std::string base = ctx_.response_id.substr(ctx_.response_id.find('-') + 1);
  if (ctx_.codec->tool_format() != TextCodec::ToolFormat::mistral)
    return "call_" + base + "_" + std::to_string(choice) + "_" + std::to_string(k);
  uint64_t h = std::hash<std::string>{}(base + "/" + std::to_string(choice) + "/" + std::to_string(k));
  static const char kChars[] = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789";
  std::string id;
  for (int i = 0; i < 9; ++i, h /= 62) id += kChars[h % 62];
  return id;
}

void Generation::send_tool_chunk(const Choice& c, const json& call) {
  json delta_call = call;
  delta_call["index"] = c.tool_calls.size();
  json chunk = {{"id", ctx_.response_id},
                {"object", "chat.completion.chunk"},
                {"created", ctx_.created},
                {"model", req_.model},
                {"choices", json::array({{{"index", c.index},
                                          {"delta", {{"tool_calls", json::array({delta_call})}}},
                                          {"logprobs", nullptr},
                                          {"finish_reason", nullptr}}})}};
  if (req_.include_usage) chunk["usage"] = nullptr;
  send_event(chunk);
}

void Generation::send_chunk(const Choice& c, const std::string& text, const json* logprobs, const char* finish,
                            bool with_role) {
  json choice;
  if (req_.kind == ApiKind::chat) {
    json delta = json::object();
    if (with_role) delta["role"] = "assistant";
    if (with_role || !text.empty()) delta["content"] = text;
    choice = {{"index", c.index}, {"delta", delta}};
  } else {
    choice = {{"index", c.index}, {"text", text}};
  }
  choice["logprobs"] = logprobs ? *logprobs : json(nullptr);
  choice["finish_reason"] = finish ? json(finish) : json(nullptr);
  json chunk = {{"id", ctx_.response_id},
                {"object", req_.kind == ApiKind::chat ? "chat.completion.chunk" : "text_completion"},
                {"created", ctx_.created},
                {"model", req_.model},
                {"choices", json::array({choice})}};
  if (req_.include_usage) chunk["usage"] = nullptr;
  send_event(chunk);
}

void Generation::send_reasoning_chunk(const Choice& c, const std::string& text, const json* logprobs) {
  json choice = {{"index", c.index},
                 {"delta", {{"reasoning_content", text}}},
                 {"logprobs", logprobs ? *logprobs : json(nullptr)},
                 {"finish_reason", nullptr}};
  json chunk = {{"id", ctx_.response_id},
                {"object", "chat.completion.chunk"},
                {"created", ctx_.created},
                {"model", req_.model},
                {"choices", json::array({choice})}};
  if (req_.include_usage) chunk["usage"] = nullptr;
  send_event(chunk);
}

void Generation::send_event(const json& payload) {
  if (over_ && !ex_->open()) return;
  // A failed send means the client is gone; abort() has then run already.
  ex_->send("data: " + dump(payload) + "\n\n");
}

}  // namespace moe::gw
