// libFuzzer entry for what a client sends: the bytes of one connection, cut
// into reads whose size the first byte picks, through the HTTP request parser;
// the body of every complete request then goes through the same JSON bounds
// and request parsing the API applies, with the demo model's real tokenizer
// and chat template, once as a chat request and once as a completion request,
// a chat's validated turns through the session store's caps, and a
// response_format's schema through the grammar (the last message's text fed
// to it, token masks over the demo vocabulary). Nothing may
// crash, leak or read out of bounds (ASan, UBSan).
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

#include "gateway/api/completion_request.h"
#include "gateway/http/http_parser.h"
#include "gateway/json_body.h"
#include "gateway/api/model_text_codec.h"
#include "gateway/state/session_store.h"
#include "gateway/structured/token_grammar.h"

using namespace moe::gw;

namespace {

const TextCodec& codec() {
  static const std::unique_ptr<TextCodec> c = [] {
    auto r = load_model_text_codec(MOE_FUZZ_MODEL);
    if (!r.ok()) __builtin_trap();
    return std::move(r.value());
  }();
  return *c;
}

// A response_format's schema as generation would walk it: the given text fed
// byte by byte, a token mask over the demo vocabulary at the start and where
// the text stops.
void grammar(const structured::Schema& schema, const std::string& text) {
  static const std::shared_ptr<const structured::GrammarVocabulary> vocab = structured::GrammarVocabulary::build(codec());
  structured::GrammarState st = structured::GrammarState::start(schema);
  (void)structured::compute_mask(schema, *vocab, st);
  for (char c : text) {
    structured::GrammarState next;
    st.feed(schema, uint8_t(c), &next);
    if (next.empty()) break;
    st = next;
  }
  (void)st.finishable(schema);
  (void)st.key();
  (void)structured::compute_mask(schema, *vocab, st);
}

void handle(const HttpRequest& req) {
  RequestLimits limits;
  limits.served_model_name = "demo-moe";
  limits.max_context = 2048;
  ChatMessages prior = {{"system", "be brief"}, {"user", "earlier"}, {"assistant", "yes"}};
  ParsedRequest chat = parse_completion_request(ApiKind::chat, std::string_view(req.body), codec(), limits, prior);
  if (auto* r = std::get_if<CompletionRequest>(&chat)) {
    ChatMessages all = prior;
    all.insert(all.end(), r->messages.begin(), r->messages.end());
    (void)SessionStore::capped(std::move(all), 8, 4096);
    if (r->response_schema) grammar(*r->response_schema, r->messages.empty() ? req.body : r->messages.back().content);
  } else {
    (void)api_error_json(std::get<ApiError>(chat));
  }
  (void)parse_completion_request(ApiKind::completion, std::string_view(req.body), codec(), limits);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const size_t read_size = 1 + data[0] % 97;
  HttpLimits limits;
  limits.max_body_bytes = 64 << 10;
  HttpRequestParser parser(limits);
  const std::string_view input(reinterpret_cast<const char*>(data) + 1, size - 1);
  std::string pending;
  for (size_t at = 0; at < input.size(); at += read_size) {
    pending.append(input.substr(at, read_size));
    for (;;) {
      const size_t used = parser.feed(pending);
      pending.erase(0, used);
      if (parser.state() == HttpRequestParser::State::error) return 0;
      if (parser.state() == HttpRequestParser::State::complete) {
        handle(parser.take_request());
        parser.reset();
        continue;
      }
      if (parser.state() == HttpRequestParser::State::headers_done) continue;
      break;  // incomplete: more bytes needed
    }
  }
  return 0;
}
