// The OpenAI layer over real TCP with a scheduler double: response and SSE
// chunk shapes, stop strings, n > 1, usage, errors, health, metrics,
// cancellation.
#include <catch2/catch.hpp>
#include <tuple>

#include <nlohmann/json.hpp>

#include "gateway/api/parameter_support.h"
#include "gateway_test_harness.h"

using namespace moe::gw;
using namespace moe::gw::test;
using nlohmann::json;

namespace {

ClientResponse post(TestGateway& gw, const std::string& path, const json& body) {
  return http(gw.port(), "POST", path, body.dump());
}

json chat(const std::string& content, json extra = json::object()) {
  json j = {{"model", "demo-moe"}, {"messages", {{{"role", "user"}, {"content", content}}}}};
  j.update(extra);
  return j;
}

void check_error(const ClientResponse& r, int status, const char* param, const char* code) {
  INFO(r.body);
  REQUIRE(r.ok);
  CHECK(r.status == status);
  json j = json::parse(r.body);
  REQUIRE(j["error"].is_object());
  CHECK(j["error"]["message"].is_string());
  CHECK_FALSE(j["error"]["message"].get<std::string>().empty());
  CHECK(j["error"]["type"] == (status >= 500 ? "server_error" : "invalid_request_error"));
  if (param) {
    CHECK(j["error"]["param"] == param);
  } else {
    CHECK(j["error"]["param"].is_null());
  }
  if (code) CHECK(j["error"]["code"] == code);
}

std::vector<json> events_json(const ClientResponse& r) {
  std::vector<json> out;
  auto ev = sse_events(r.body);
  REQUIRE_FALSE(ev.empty());
  CHECK(ev.back() == "[DONE]");
  for (size_t i = 0; i + 1 < ev.size(); ++i) out.push_back(json::parse(ev[i]));
  return out;
}

}  // namespace

TEST_CASE("api: chat completion, whole response", "[gateway][api]") {
  TestGateway gw;
  auto r = post(gw, "/v1/chat/completions", chat("hi", {{"temperature", 0}, {"seed", 7}, {"top_k", 5}}));
  REQUIRE(r.ok);
  REQUIRE(r.status == 200);
  CHECK(r.headers["content-type"] == "application/json");
  CHECK(r.headers.count("x-moe-degraded") == 0);
  // The response's id is its request id, as clients' SDKs read it.
  CHECK(r.headers["x-request-id"] == json::parse(r.body)["id"]);
  json j = json::parse(r.body);
  CHECK(j["id"].get<std::string>().rfind("chatcmpl-", 0) == 0);
  CHECK(j["object"] == "chat.completion");
  CHECK(j["created"].is_number_integer());
  CHECK(j["model"] == "demo-moe");
  REQUIRE(j["choices"].size() == 1);
  CHECK(j["choices"][0]["index"] == 0);
  CHECK(j["choices"][0]["message"]["role"] == "assistant");
  CHECK(j["choices"][0]["message"]["content"] == "Hello world");
  CHECK(j["choices"][0]["finish_reason"] == "stop");
  CHECK(j["choices"][0]["logprobs"].is_null());
  // The prompt went through the chat template; 11 letters + EOS generated.
  std::string prompt = "user: hi\nassistant:";
  CHECK(j["usage"]["prompt_tokens"] == prompt.size());
  CHECK(j["usage"]["completion_tokens"] == 12);
  CHECK(j["usage"]["total_tokens"] == prompt.size() + 12);
  auto sub = gw.scheduler().submitted();
  REQUIRE(sub.size() == 1);
  CHECK(sub[0].prompt == byte_tokens(prompt));
  CHECK(sub[0].sampling.temperature == 0.0f);
  CHECK(sub[0].sampling.seed == 7);
  CHECK(sub[0].sampling.top_k == 5);
  CHECK(sub[0].stop_ids == std::vector<int32_t>{ByteCodec::kEos});
  // No max_tokens: until EOS or the end of the context.
  CHECK(sub[0].max_new_tokens == 4096 - static_cast<int>(prompt.size()));
}

TEST_CASE("api: max_tokens ends with finish_reason length", "[gateway][api]") {
  TestGateway gw;
  auto r = post(gw, "/v1/chat/completions", chat("hi", {{"max_completion_tokens", 4}}));
  json j = json::parse(r.body);
  CHECK(j["choices"][0]["message"]["content"] == "Hell");
  CHECK(j["choices"][0]["finish_reason"] == "length");
  CHECK(j["usage"]["completion_tokens"] == 4);
}

TEST_CASE("api: chat stream chunks: role first, content, finish, [DONE]", "[gateway][api][sse]") {
  TestGateway gw;
  auto r = post(gw, "/v1/chat/completions", chat("hi", {{"stream", true}}));
  REQUIRE(r.ok);
  CHECK(r.status == 200);
  CHECK(r.headers["content-type"] == "text/event-stream");
  CHECK(r.headers["transfer-encoding"] == "chunked");
  auto ev = events_json(r);
  REQUIRE(ev.size() >= 3);
  std::string id = ev[0]["id"];
  CHECK(id.rfind("chatcmpl-", 0) == 0);
  for (const auto& e : ev) {
    CHECK(e["id"] == id);
    CHECK(e["object"] == "chat.completion.chunk");
    CHECK(e["model"] == "demo-moe");
    CHECK(e.contains("created"));
    CHECK_FALSE(e.contains("usage"));
    REQUIRE(e["choices"].size() == 1);
  }
  CHECK(ev[0]["choices"][0]["delta"] == json({{"role", "assistant"}, {"content", ""}}));
  CHECK(ev[0]["choices"][0]["finish_reason"].is_null());
  std::string text;
  for (size_t i = 1; i + 1 < ev.size(); ++i) {
    const auto& d = ev[i]["choices"][0]["delta"];
    CHECK_FALSE(d.contains("role"));
    text += d["content"].get<std::string>();
    CHECK(ev[i]["choices"][0]["finish_reason"].is_null());
  }
  CHECK(text == "Hello world");
  CHECK(ev.back()["choices"][0]["delta"] == json::object());
  CHECK(ev.back()["choices"][0]["finish_reason"] == "stop");
}

TEST_CASE("api: stream_options.include_usage adds a usage chunk with no choices", "[gateway][api][sse]") {
  TestGateway gw;
  auto r = post(gw, "/v1/chat/completions",
                chat("hi", {{"stream", true}, {"max_tokens", 3}, {"stream_options", {{"include_usage", true}}}}));
  auto ev = events_json(r);
  for (size_t i = 0; i + 1 < ev.size(); ++i) CHECK(ev[i]["usage"].is_null());
  const auto& last = ev.back();
  CHECK(last["choices"] == json::array());
  CHECK(last["usage"]["completion_tokens"] == 3);
  CHECK(last["usage"]["prompt_tokens"] == std::string("user: hi\nassistant:").size());
  CHECK(ev[ev.size() - 2]["choices"][0]["finish_reason"] == "length");
}

TEST_CASE("api: completions, whole and streamed", "[gateway][api][sse]") {
  TestGateway gw;
  auto r = post(gw, "/v1/completions", {{"model", "demo-moe"}, {"prompt", "abc"}, {"max_tokens", 5}});
  json j = json::parse(r.body);
  CHECK(j["id"].get<std::string>().rfind("cmpl-", 0) == 0);
  CHECK(j["object"] == "text_completion");
  CHECK(j["choices"][0]["text"] == "Hello");
  CHECK(j["choices"][0]["finish_reason"] == "length");
  CHECK(j["usage"]["prompt_tokens"] == 3);
  CHECK(gw.scheduler().submitted()[0].prompt == byte_tokens("abc"));

  auto s = post(gw, "/v1/completions", {{"model", "demo-moe"}, {"prompt", {1, 2, 3}}, {"stream", true}});
  auto ev = events_json(s);
  std::string text;
  for (const auto& e : ev) {
    CHECK(e["object"] == "text_completion");
    text += e["choices"][0]["text"].get<std::string>();
  }
  CHECK(text == "Hello world");
  CHECK(ev.back()["choices"][0]["finish_reason"] == "stop");
  CHECK(gw.scheduler().submitted()[1].prompt == std::vector<int32_t>{1, 2, 3});
}

TEST_CASE("api: stop strings are held back across token boundaries and never shown", "[gateway][api][stop]") {
  TestGateway gw;
  gw.scheduler().set_script(spell("one two END three"));
  SECTION("streamed") {
    auto r = post(gw, "/v1/chat/completions", chat("x", {{"stream", true}, {"stop", "END"}}));
    auto ev = events_json(r);
    std::string text;
    for (const auto& e : ev) {
      const auto& d = e["choices"][0]["delta"];
      if (d.contains("content")) {
        std::string piece = d["content"];
        CHECK(piece.find('E') == std::string::npos);  // no part of the stop string, ever
        text += piece;
      }
    }
    CHECK(text == "one two ");
    CHECK(ev.back()["choices"][0]["finish_reason"] == "stop");
  }
  SECTION("whole, several stop strings, the sequence is cancelled at the match") {
    auto r = post(gw, "/v1/completions",
                  {{"model", "demo-moe"}, {"prompt", "p"}, {"stop", {"zzz", "two E"}}, {"max_tokens", 100}});
    json j = json::parse(r.body);
    CHECK(j["choices"][0]["text"] == "one ");
    CHECK(j["choices"][0]["finish_reason"] == "stop");
    CHECK(j["usage"]["completion_tokens"] == 9);  // "one two E"
    CHECK(gw.scheduler().cancelled().size() == 1);
  }
  SECTION("a false start is shown once it is ruled out") {
    gw.scheduler().set_script(spell("a EN b"));
    auto r = post(gw, "/v1/completions", {{"model", "demo-moe"}, {"prompt", "p"}, {"stop", "END"}});
    json j = json::parse(r.body);
    CHECK(j["choices"][0]["text"] == "a EN b");
    CHECK(j["choices"][0]["finish_reason"] == "stop");  // by EOS
  }
}

TEST_CASE("api: multi-byte characters split over tokens come out whole", "[gateway][api][sse]") {
  TestGateway gw;
  gw.scheduler().set_script(spell("h\xC3\xA9\xE2\x82\xAC!"));  // "h", "é", "€", "!"
  auto r = post(gw, "/v1/chat/completions", chat("x", {{"stream", true}}));
  auto ev = events_json(r);
  std::vector<std::string> pieces;
  for (size_t i = 1; i + 1 < ev.size(); ++i) pieces.push_back(ev[i]["choices"][0]["delta"]["content"]);
  CHECK(pieces == std::vector<std::string>{"h", "\xC3\xA9", "\xE2\x82\xAC", "!"});
}

TEST_CASE("api: n > 1 runs one sequence per choice with seeds seed+i", "[gateway][api]") {
  TestGateway gw;
  gw.scheduler().set_script([](const SequenceRequest& req, int step) -> int32_t {
    std::string text = "choice" + std::to_string(req.sampling.seed);
    return step < static_cast<int>(text.size()) ? static_cast<int32_t>(text[step]) : ByteCodec::kEos;
  });
  auto r = post(gw, "/v1/chat/completions", chat("x", {{"n", 3}, {"seed", 40}}));
  json j = json::parse(r.body);
  REQUIRE(j["choices"].size() == 3);
  for (int i = 0; i < 3; ++i) {
    CHECK(j["choices"][i]["index"] == i);
    CHECK(j["choices"][i]["message"]["content"] == "choice" + std::to_string(40 + i));
  }
  CHECK(j["usage"]["completion_tokens"] == 3 * 9);
  CHECK(j["usage"]["prompt_tokens"] == std::string("user: x\nassistant:").size());

  auto s = post(gw, "/v1/chat/completions", chat("x", {{"n", 2}, {"seed", 1}, {"stream", true}}));
  auto ev = events_json(s);
  std::map<int, std::string> text;
  std::map<int, int> finishes;
  for (const auto& e : ev) {
    int idx = e["choices"][0]["index"];
    const auto& d = e["choices"][0]["delta"];
    if (d.contains("content")) text[idx] += d["content"].get<std::string>();
    if (!e["choices"][0]["finish_reason"].is_null()) ++finishes[idx];
  }
  CHECK(text[0] == "choice1");
  CHECK(text[1] == "choice2");
  CHECK(finishes[0] == 1);
  CHECK(finishes[1] == 1);
}

TEST_CASE("api: a list of prompts gives prompts x n choices", "[gateway][api]") {
  TestGateway gw;
  auto r = post(gw, "/v1/completions", {{"model", "demo-moe"}, {"prompt", {"a", "bb"}}, {"n", 2}, {"max_tokens", 2}});
  json j = json::parse(r.body);
  REQUIRE(j["choices"].size() == 4);
  auto sub = gw.scheduler().submitted();
  REQUIRE(sub.size() == 4);
  CHECK(sub[0].prompt == byte_tokens("a"));
  CHECK(sub[1].prompt == byte_tokens("a"));
  CHECK(sub[2].prompt == byte_tokens("bb"));
  CHECK(j["usage"]["prompt_tokens"] == 3);
}

TEST_CASE("api: logprobs in the chat and completions shapes", "[gateway][api]") {
  TestGateway gw;
  auto r = post(gw, "/v1/chat/completions", chat("x", {{"logprobs", true}, {"top_logprobs", 2}, {"max_tokens", 2}}));
  json j = json::parse(r.body);
  const auto& content = j["choices"][0]["logprobs"]["content"];
  REQUIRE(content.size() == 2);
  CHECK(content[0]["token"] == "H");
  CHECK(content[0]["logprob"] == Approx(-2.0));  // the scripted scheduler's capitals: -2
  CHECK(content[1]["logprob"] == Approx(-0.5));
  CHECK(content[0]["bytes"] == json::array({72}));
  CHECK(content[0]["top_logprobs"].size() == 2);
  CHECK(gw.scheduler().submitted()[0].sampling.top_logprobs == 2);

  auto c = post(gw, "/v1/completions", {{"model", "demo-moe"}, {"prompt", "p"}, {"logprobs", 1}, {"max_tokens", 2}});
  json k = json::parse(c.body);
  CHECK(k["choices"][0]["logprobs"]["tokens"] == json::array({"H", "e"}));
  CHECK(k["choices"][0]["logprobs"]["text_offset"] == json::array({0, 1}));

  // A character over two tokens (one byte each): chat's "bytes" are each
  // token's own, so joined they give the character back; completions name
  // such a token "bytes:\xNN" (as text every one would read U+FFFD).
  gw.scheduler().set_script(spell("\xC3\xA9"));  // "é"
  json u = json::parse(post(gw, "/v1/chat/completions", chat("x", {{"logprobs", true}})).body);
  const auto& lp = u["choices"][0]["logprobs"]["content"];
  REQUIRE(lp.size() == 2);
  CHECK(lp[0]["bytes"] == json::array({0xC3}));
  CHECK(lp[1]["bytes"] == json::array({0xA9}));
  CHECK(u["choices"][0]["message"]["content"] == "\xC3\xA9");
  json v = json::parse(post(gw, "/v1/completions", {{"model", "demo-moe"}, {"prompt", "p"}, {"logprobs", 1}}).body);
  CHECK(v["choices"][0]["logprobs"]["tokens"] == json::array({"bytes:\\xc3", "bytes:\\xa9"}));

  // text_offset counts characters of the text, as a client indexing it
  // does: after "é" (two bytes, one character) the next token starts at 1.
  gw.scheduler().set_script(spell("\xC3\xA9xy"));
  json w = json::parse(post(gw, "/v1/completions", {{"model", "demo-moe"}, {"prompt", "p"}, {"logprobs", 1}}).body);
  CHECK(w["choices"][0]["text"] == "\xC3\xA9xy");
  CHECK(w["choices"][0]["logprobs"]["text_offset"] == json::array({0, 0, 1, 2}));
}

TEST_CASE("api: a stop string's tokens leave a whole response's logprobs with its text", "[gateway][api]") {
  TestGateway gw;
  // One byte a token: "ab" is kept; "END" is the stop string, "z" after it
  // never shows. (A token that straddles the cut shows in part and keeps its
  // entry: the byte codec here has none.)
  gw.scheduler().set_script(spell("abENDz"));
  json k = json::parse(post(gw, "/v1/completions", {{"model", "demo-moe"}, {"prompt", "p"}, {"logprobs", 1},
                                                     {"stop", "END"}}).body);
  CHECK(k["choices"][0]["text"] == "ab");
  CHECK(k["choices"][0]["finish_reason"] == "stop");
  CHECK(k["choices"][0]["logprobs"]["tokens"] == json::array({"a", "b"}));
  CHECK(k["choices"][0]["logprobs"]["text_offset"] == json::array({0, 1}));
  CHECK(k["choices"][0]["logprobs"]["token_logprobs"].size() == 2);
  CHECK(k["choices"][0]["logprobs"]["top_logprobs"].size() == 2);
  gw.scheduler().set_script(spell("abENDz"));
  json c = json::parse(post(gw, "/v1/chat/completions", chat("x", {{"logprobs", true}, {"stop", "END"}})).body);
  CHECK(c["choices"][0]["message"]["content"] == "ab");
  REQUIRE(c["choices"][0]["logprobs"]["content"].size() == 2);
  CHECK(c["choices"][0]["logprobs"]["content"][1]["token"] == "b");

  // Text held back because it may begin a stop string still has its place:
  // "XY" waits as the start of "XYQ", then "E" as the start of "END", which
  // ends the choice. Each token's offset is where its text starts in the
  // text, and the tokens of the stop string ("E", "N", "D") leave, "E" too.
  for (const bool stream : {false, true}) {
    gw.scheduler().set_script(spell("abXYENDz"));
    const json req = {{"model", "demo-moe"}, {"prompt", "p"}, {"logprobs", 1}, {"stream", stream},
                      {"stop", {"XYQ", "END"}}};
    const auto r = post(gw, "/v1/completions", req);
    json tokens = json::array(), offsets = json::array();
    std::string text;
    if (stream) {
      for (const json& ev : events_json(r)) {
        const json& ch = ev["choices"][0];
        text += ch["text"].get<std::string>();
        if (ch.contains("logprobs") && ch["logprobs"].is_object())
          for (size_t i = 0; i < ch["logprobs"]["tokens"].size(); ++i) {
            tokens.push_back(ch["logprobs"]["tokens"][i]);
            offsets.push_back(ch["logprobs"]["text_offset"][i]);
          }
      }
    } else {
      const json k2 = json::parse(r.body);
      text = k2["choices"][0]["text"];
      tokens = k2["choices"][0]["logprobs"]["tokens"];
      offsets = k2["choices"][0]["logprobs"]["text_offset"];
    }
    INFO("stream " << stream);
    CHECK(text == "abXY");
    // Streamed or whole, the same entries: a stream sends each with its
    // text (held back with it), and the stop string's never.
    CHECK(tokens == json::array({"a", "b", "X", "Y"}));
    CHECK(offsets == json::array({0, 1, 2, 3}));
    // Chat the same.
    gw.scheduler().set_script(spell("abXYENDz"));
    const auto rc = post(gw, "/v1/chat/completions",
                         chat("x", {{"logprobs", true}, {"stream", stream}, {"stop", {"XYQ", "END"}}}));
    json chat_tokens = json::array();
    if (stream) {
      for (const json& ev : events_json(rc))
        if (!ev["choices"].empty() && ev["choices"][0].contains("logprobs") && ev["choices"][0]["logprobs"].is_object())
          for (const json& e : ev["choices"][0]["logprobs"]["content"]) chat_tokens.push_back(e["token"]);
    } else {
      const json whole = json::parse(rc.body);
      for (const json& e : whole["choices"][0]["logprobs"]["content"]) chat_tokens.push_back(e["token"]);
    }
    CHECK(chat_tokens == json::array({"a", "b", "X", "Y"}));
  }
}

TEST_CASE("api: validation errors have OpenAI's shape and status", "[gateway][api][errors]") {
  TestGateway gw;
  int port = gw.port();
  check_error(http(port, "POST", "/v1/chat/completions", "{not json"), 400, nullptr, "invalid_json");
  check_error(http(port, "POST", "/v1/chat/completions", "[1,2]"), 400, nullptr, "invalid_json");
  check_error(http(port, "POST", "/v1/chat/completions",
                   "{\"model\":\"demo-moe\",\"messages\":[{\"role\":\"user\",\"content\":\"\xff\xfe\"}]}"),
              400, nullptr, "invalid_utf8");
  check_error(http(port, "POST", "/v1/chat/completions",
                   R"({"model":"demo-moe","messages":[{"role":"user","content":"\ud800"}]})"),
              400, nullptr, "invalid_utf8");
  check_error(post(gw, "/v1/chat/completions", {{"messages", json::array()}}), 400, "model", "missing_required_parameter");
  check_error(post(gw, "/v1/chat/completions", {{"model", "demo-moe"}}), 400, "messages", "missing_required_parameter");
  check_error(post(gw, "/v1/completions", {{"model", "demo-moe"}}), 400, "prompt", "missing_required_parameter");
  check_error(post(gw, "/v1/chat/completions", chat("x", {{"model", "gpt-9"}})), 404, "model", "model_not_found");
  check_error(post(gw, "/v1/chat/completions", chat("x", {{"model", 5}})), 400, "model", "invalid_type");
  check_error(post(gw, "/v1/chat/completions", chat("x", {{"max_tokens", "5"}})), 400, "max_tokens", "invalid_type");
  check_error(post(gw, "/v1/chat/completions", chat("x", {{"max_tokens", 2.5}})), 400, "max_tokens", "invalid_type");
  check_error(post(gw, "/v1/chat/completions", chat("x", {{"max_tokens", 0}})), 400, "max_tokens", "invalid_value");
  check_error(post(gw, "/v1/chat/completions", chat("x", {{"max_completion_tokens", -3}})), 400,
              "max_completion_tokens", "invalid_value");
  check_error(post(gw, "/v1/chat/completions", chat("x", {{"max_tokens", 5000}})), 400, "max_tokens",
              "context_length_exceeded");
  check_error(post(gw, "/v1/completions", {{"model", "demo-moe"}, {"prompt", std::string(4096, 'a')}}), 400, "prompt",
              "context_length_exceeded");
  check_error(post(gw, "/v1/chat/completions", chat("x", {{"temperature", 3}})), 400, "temperature", "invalid_value");
  // A content part this server does not take says so with a code.
  check_error(post(gw, "/v1/chat/completions",
                   {{"model", "demo-moe"},
                    {"messages", {{{"role", "user"},
                                   {"content", {{{"type", "image_url"}, {"image_url", {{"url", "http://x/a.png"}}}}}}}}}}),
              400, "messages[0].content", "unsupported_value");
  check_error(post(gw, "/v1/chat/completions", chat("x", {{"temperature", "hot"}})), 400, "temperature", "invalid_type");
  check_error(post(gw, "/v1/chat/completions", chat("x", {{"top_p", 0}})), 400, "top_p", "invalid_value");
  check_error(post(gw, "/v1/chat/completions", chat("x", {{"n", 0}})), 400, "n", "invalid_value");
  check_error(post(gw, "/v1/chat/completions", chat("x", {{"stream", "yes"}})), 400, "stream", "invalid_type");
  check_error(post(gw, "/v1/chat/completions", chat("x", {{"stop", {"a", "b", "c", "d", "e"}}})), 400, "stop",
              "invalid_value");
  check_error(post(gw, "/v1/chat/completions", chat("x", {{"stop", 5}})), 400, "stop", "invalid_type");
  check_error(post(gw, "/v1/chat/completions", chat("x", {{"stream_options", {{"include_usage", true}}}})), 400,
              "stream_options", "invalid_value");
  check_error(post(gw, "/v1/chat/completions", {{"model", "demo-moe"}, {"messages", "hi"}}), 400, "messages",
              "invalid_type");
  check_error(post(gw, "/v1/chat/completions", {{"model", "demo-moe"}, {"messages", {{{"content", "hi"}}}}}), 400,
              "messages[0].role", "missing_required_parameter");
  check_error(post(gw, "/v1/chat/completions", {{"model", "demo-moe"}, {"messages", {{{"role", "wizard"}, {"content", "x"}}}}}),
              400, "messages[0].role", "invalid_value");
  // null content is an assistant's alone.
  for (const char* role : {"user", "system", "tool"})
    check_error(post(gw, "/v1/chat/completions",
                     {{"model", "demo-moe"}, {"messages", {{{"role", role}, {"content", nullptr}}}}}),
                400, "messages[0].content", "invalid_type");
  check_error(post(gw, "/v1/chat/completions", chat("x", {{"logprobs", true}, {"top_logprobs", 21}})), 400,
              "top_logprobs", "invalid_value");
  check_error(post(gw, "/v1/completions", {{"model", "demo-moe"}, {"prompt", {1, 99999}}}), 400, "prompt", "invalid_value");
  check_error(post(gw, "/v1/completions", {{"model", "demo-moe"}, {"prompt", {"a", 1}}}), 400, "prompt", "invalid_type");
  check_error(http(port, "GET", "/v2/whatever"), 404, nullptr, "unknown_url");
  auto m = http(port, "GET", "/v1/chat/completions");
  check_error(m, 405, nullptr, "method_not_allowed");
  CHECK(m.headers["allow"] == "POST");
  check_error(http(port, "DELETE", "/v1/models"), 405, nullptr, "method_not_allowed");
  check_error(http(port, "GET", "/v1/models/other"), 404, "model", "model_not_found");
  CHECK(gw.scheduler().submitted().empty());
}

TEST_CASE("api: a parameter not honoured is refused when it asks for something, accepted at its default",
          "[gateway][api][errors]") {
  TestGateway gw;
  // Asking for something: 400 unsupported_parameter naming it, nothing submitted.
  const std::vector<std::pair<std::string, json>> chat_refused = {
      {"reasoning_effort", "low"},
      {"audio", {{"voice", "x"}, {"format", "wav"}}},
      {"modalities", {"text", "audio"}},
      {"guided_json", {{"type", "object"}}},
      {"store", true},
      {"allowed_token_ids", {1, 2}},
      {"repeat_penalty", 1.1},
  };
  for (const auto& [name, value] : chat_refused) {
    INFO(name << " = " << value.dump());
    check_error(post(gw, "/v1/chat/completions", chat("x", {{name, value}})), 400, name.c_str(), "unsupported_parameter");
  }
  for (const auto& [name, value] : std::vector<std::pair<std::string, json>>{
           {"suffix", "tail"}}) {
    INFO(name << " = " << value.dump());
    check_error(post(gw, "/v1/completions", {{"model", "demo-moe"}, {"prompt", "x"}, {name, value}}), 400, name.c_str(),
                "unsupported_parameter");
  }
  // The deprecated function_call of an assistant turn cannot be rendered.
  json with_call = {{"model", "demo-moe"},
                    {"messages",
                     {{{"role", "user"}, {"content", "x"}},
                      {{"role", "assistant"}, {"content", nullptr}, {"function_call", {{"name", "f"}, {"arguments", "{}"}}}}}}};
  check_error(post(gw, "/v1/chat/completions", with_call), 400, "messages[1].function_call", "unsupported_parameter");
  CHECK(gw.scheduler().submitted().empty());

  // Asking for nothing (the defaults SDKs send), and keys no API names: served.
  const json defaults = {{"frequency_penalty", 0},  {"presence_penalty", 0.0}, {"logit_bias", json::object()},
                         {"response_format", {{"type", "text"}}}, {"tools", json::array()}, {"tool_choice", "none"},
                         {"store", false},           {"service_tier", "flex"}, {"modalities", {"text"}},
                         {"prediction", {{"type", "content"}, {"content", "x"}}}, {"allowed_token_ids", json::array()},
                         {"parallel_tool_calls", true}, {"metadata", {{"k", "v"}}}, {"some_extension", 1},
                         {"repetition_penalty", 1}, {"min_p", 0}, {"ignore_eos", false}, {"max_tokens", 4}};
  auto r = post(gw, "/v1/chat/completions", chat("x", defaults));
  INFO(r.body);
  CHECK(r.status == 200);
  auto c = post(gw, "/v1/completions", {{"model", "demo-moe"}, {"prompt", "x"}, {"max_tokens", 4}, {"suffix", ""},
                                        {"frequency_penalty", 0}, {"presence_penalty", 0}, {"logit_bias", json::object()}});
  INFO(c.body);
  CHECK(c.status == 200);
  // Each refused parameter has its accepted values written down (docs/gateway.md's table).
  for (const auto& p : unsupported_parameters()) CHECK(std::string(p.accepted).size() > 0);
}

TEST_CASE("api: /tokenize and /detokenize, and their refusals", "[gateway][api][tokenize]") {
  TestGateway gw;
  auto t = post(gw, "/tokenize", {{"model", "demo-moe"}, {"prompt", "hi"}});
  REQUIRE(t.status == 200);
  json tj = json::parse(t.body);
  CHECK(tj["tokens"] == json::array({'h', 'i'}));
  CHECK(tj["count"] == 2);
  auto c = post(gw, "/tokenize", {{"messages", {{{"role", "user"}, {"content", "x"}}}}});
  REQUIRE(c.status == 200);
  CHECK(json::parse(c.body)["tokens"] == byte_tokens("user: x\nassistant:"));
  auto d = post(gw, "/detokenize", {{"tokens", {'o', 'k'}}});
  REQUIRE(d.status == 200);
  CHECK(json::parse(d.body)["prompt"] == "ok");
  check_error(post(gw, "/tokenize", {{"model", "gpt-9"}, {"prompt", "x"}}), 404, "model", "model_not_found");
  check_error(post(gw, "/tokenize", json::object()), 400, "prompt", "missing_required_parameter");
  check_error(post(gw, "/tokenize", {{"prompt", "x"}, {"messages", json::array()}}), 400, "messages", "invalid_value");
  check_error(post(gw, "/tokenize", {{"prompt", 5}}), 400, "prompt", "invalid_type");
  check_error(post(gw, "/tokenize", {{"prompt", "x"}, {"add_special_tokens", false}}), 400, "add_special_tokens",
              "unsupported_parameter");
  // What the chat endpoint refuses is refused here too.
  check_error(post(gw, "/tokenize", {{"messages", {{{"role", "user"}, {"content", "x"}},
                                                   {{"role", "assistant"}, {"tool_calls", {{{"id", "1"}}}}}}}}),
              400, "messages[1].tool_calls[0]", "invalid_type");
  check_error(post(gw, "/tokenize", {{"messages", {{{"role", "user"}, {"content", "x"}}}}, {"tools", "f"}}), 400,
              "tools", "invalid_type");
  // Tools reach the template (this one writes them as JSON).
  auto with_tools = post(gw, "/tokenize", {{"messages", {{{"role", "user"}, {"content", "x"}}}},
                                          {"tools", {{{"type", "function"}, {"function", {{"name", "f"}}}}}}});
  REQUIRE(with_tools.status == 200);
  CHECK(json::parse(with_tools.body)["count"].get<int>() > 40);
  check_error(post(gw, "/tokenize", {{"messages", {{{"role", "user"}, {"content", "x"}}}},
                                     {"chat_template_kwargs", {{"messages", 1}}}}),
              400, "chat_template_kwargs", "invalid_value");
  check_error(post(gw, "/detokenize", json::object()), 400, "tokens", "missing_required_parameter");
  check_error(post(gw, "/detokenize", {{"tokens", {1, 999}}}), 400, "tokens", "invalid_value");
  check_error(post(gw, "/detokenize", {{"tokens", "abc"}}), 400, "tokens", "invalid_type");
  check_error(http(gw.port(), "GET", "/tokenize"), 405, nullptr, "method_not_allowed");
  CHECK(gw.scheduler().submitted().empty());  // nothing ran on a worker
}

TEST_CASE("api: stop_token_ids end a choice at those ids; ignore_eos runs past EOS", "[gateway][api][stop]") {
  TestGateway gw;
  // "ab" EOS "cd" EOS ...: the script keeps going after EOS.
  gw.scheduler().set_script([](const SequenceRequest&, int step) -> int32_t {
    static const int32_t ids[] = {'a', 'b', ByteCodec::kEos, 'c', 'd', '!', 'e'};
    return step < 7 ? ids[step] : 'z';
  });
  auto body = [](json extra) {
    json j = {{"model", "demo-moe"}, {"prompt", "x"}, {"max_tokens", 6}};
    if (extra.is_object()) j.update(extra);
    return j;
  };
  json plain = json::parse(post(gw, "/v1/completions", body({})).body);
  CHECK(plain["choices"][0]["text"] == "ab");
  CHECK(plain["choices"][0]["finish_reason"] == "stop");
  json ignored = json::parse(post(gw, "/v1/completions", body({{"ignore_eos", true}})).body);
  CHECK(ignored["choices"][0]["text"] == "abcd!");  // EOS not shown, not an end
  CHECK(ignored["choices"][0]["finish_reason"] == "length");
  CHECK(ignored["usage"]["completion_tokens"] == 6);
  CHECK(gw.scheduler().submitted().back().stop_ids.empty());
  json bang = json::parse(post(gw, "/v1/completions", body({{"ignore_eos", true}, {"stop_token_ids", {'!'}}})).body);
  CHECK(bang["choices"][0]["text"] == "abcd");  // the stop id ends it and is not shown
  CHECK(bang["choices"][0]["finish_reason"] == "stop");
  json both = json::parse(post(gw, "/v1/completions", body({{"stop_token_ids", {'b'}}})).body);
  CHECK(both["choices"][0]["text"] == "a");
  check_error(post(gw, "/v1/completions", body({{"stop_token_ids", {999}}})), 400, "stop_token_ids", "invalid_value");
  check_error(post(gw, "/v1/completions", body({{"stop_token_ids", "a"}})), 400, "stop_token_ids", "invalid_type");
  check_error(post(gw, "/v1/completions", body({{"ignore_eos", "yes"}})), 400, "ignore_eos", "invalid_type");
}

TEST_CASE("api: penalties, min_p, logit_bias and min_tokens reach the sequence; out of range is 400",
          "[gateway][api][sampling]") {
  TestGateway gw;
  auto body = [](json extra) {
    json j = {{"model", "demo-moe"}, {"prompt", "x"}, {"max_tokens", 6}};
    j.update(extra);
    return j;
  };
  auto r = post(gw, "/v1/completions",
                body({{"presence_penalty", 0.5}, {"frequency_penalty", -1.25}, {"repetition_penalty", 1.1},
                      {"min_p", 0.05}, {"logit_bias", {{"98", -100}, {"7", 2.5}}}, {"min_tokens", 3}}));
  INFO(r.body);
  REQUIRE(r.status == 200);
  const SequenceRequest sub = gw.scheduler().submitted().back();
  CHECK(sub.sampling.presence_penalty == 0.5f);
  CHECK(sub.sampling.frequency_penalty == -1.25f);
  CHECK(sub.sampling.repetition_penalty == 1.1f);
  CHECK(sub.sampling.min_p == 0.05f);
  CHECK(sub.logit_bias == std::vector<std::pair<int32_t, float>>{{7, 2.5f}, {98, -100.0f}});
  CHECK(sub.min_tokens == 3);
  // Chat takes them too; the defaults ask for nothing.
  REQUIRE(post(gw, "/v1/chat/completions", chat("x", {{"frequency_penalty", 1}, {"min_tokens", 2}})).status == 200);
  CHECK(gw.scheduler().submitted().back().sampling.frequency_penalty == 1.0f);
  REQUIRE(post(gw, "/v1/completions", body(json::object())).status == 200);
  CHECK(gw.scheduler().submitted().back().sampling.repetition_penalty == 1.0f);
  // A top_p too small for a float stays above 0 (the best token alone), as the worker requires.
  REQUIRE(post(gw, "/v1/completions", body({{"top_p", 1e-50}})).status == 200);
  CHECK(gw.scheduler().submitted().back().sampling.top_p > 0.0f);
  CHECK(moe::protocol::sampling_problem(gw.scheduler().submitted().back().sampling).empty());
  CHECK(gw.scheduler().submitted().back().logit_bias.empty());

  const std::vector<std::tuple<json, const char*, const char*>> bad = {
      {{{"presence_penalty", 2.5}}, "presence_penalty", "invalid_value"},
      {{{"frequency_penalty", -3}}, "frequency_penalty", "invalid_value"},
      {{{"frequency_penalty", "1"}}, "frequency_penalty", "invalid_type"},
      {{{"repetition_penalty", 0}}, "repetition_penalty", "invalid_value"},
      {{{"min_p", 1.5}}, "min_p", "invalid_value"},
      {{{"min_tokens", -1}}, "min_tokens", "invalid_value"},
      {{{"min_tokens", 7}}, "min_tokens", "invalid_value"},  // above max_tokens
      {{{"min_tokens", 1.5}}, "min_tokens", "invalid_type"},
      {{{"logit_bias", {{"7", 101}}}}, "logit_bias", "invalid_value"},
      {{{"logit_bias", {{"7", "x"}}}}, "logit_bias", "invalid_value"},
      {{{"logit_bias", {{"abc", 1}}}}, "logit_bias", "invalid_value"},
      {{{"logit_bias", {{"-4", 1}}}}, "logit_bias", "invalid_value"},
      {{{"logit_bias", {{"999999", 1}}}}, "logit_bias", "invalid_value"},  // outside the vocabulary
      {{{"logit_bias", {{"7", 1}, {"007", 2}}}}, "logit_bias", "invalid_value"},
      {{{"logit_bias", json::array({1})}}, "logit_bias", "invalid_type"},
      {{{"min_tokens", 2}, {"response_format", {{"type", "json_object"}}}}, "min_tokens", "invalid_value"},
      {{{"ignore_eos", true}, {"response_format", {{"type", "json_object"}}}}, "ignore_eos", "invalid_value"},
      // Below what a float holds (it would reach the worker as 0), and a
      // divisor that overflows a logit.
      {{{"repetition_penalty", 1e-300}}, "repetition_penalty", "invalid_value"},
      {{{"repetition_penalty", 0.009}}, "repetition_penalty", "invalid_value"},
  };
  for (const auto& [extra, param, code] : bad) {
    INFO(extra.dump());
    check_error(post(gw, "/v1/completions", body(extra)), 400, param, code);
  }
}

TEST_CASE("api: min_tokens holds stop strings back until that many tokens came", "[gateway][api][stop]") {
  TestGateway gw;
  gw.scheduler().set_script([](const SequenceRequest&, int step) -> int32_t {
    static const int32_t ids[] = {'a', '.', 'b', '.', 'c', 'd'};
    return step < 6 ? ids[step] : 'z';
  });
  auto run = [&](int min_tokens) {
    json j = {{"model", "demo-moe"}, {"prompt", "x"}, {"max_tokens", 6}, {"stop", "."}, {"min_tokens", min_tokens}};
    return json::parse(post(gw, "/v1/completions", j).body)["choices"][0]["text"].get<std::string>();
  };
  CHECK(run(0) == "a");
  CHECK(run(2) == "a.b");  // the first two tokens pass unseen; the next "." ends it
  CHECK(run(4) == "a.b.cd");
}

TEST_CASE("api: a seed past int64 is refused, not clamped onto another seed's draws", "[gateway][api]") {
  TestGateway gw;
  // 2^63 and 2^64 - 1 were both read as 2^63 - 1: three seeds, one stream of draws.
  for (const char* seed : {"9223372036854775808", "18446744073709551615"}) {
    INFO(seed);
    auto r = http(gw.port(), "POST", "/v1/completions",
                  std::string(R"({"model":"demo-moe","prompt":"x","max_tokens":1,"seed":)") + seed + "}");
    CHECK(r.status == 400);
    const json e = json::parse(r.body)["error"];
    CHECK(e["param"] == "seed");
    CHECK(e["code"] == "invalid_value");
  }
  // The ends of the range are seeds like any other.
  for (const char* seed : {"9223372036854775807", "-9223372036854775808"}) {
    auto r = http(gw.port(), "POST", "/v1/completions",
                  std::string(R"({"model":"demo-moe","prompt":"x","max_tokens":1,"seed":)") + seed + "}");
    CHECK(r.status == 200);
  }
}

TEST_CASE("api: completions echo the prompt; best_of returns the n likeliest of its candidates", "[gateway][api]") {
  TestGateway gw;
  // Choice i (seed 100 + i): candidates 1 and 3 speak in capitals (log probability -2 a token), the others not (-0.5).
  gw.scheduler().set_script([](const SequenceRequest& req, int step) -> int32_t {
    const bool loud = req.sampling.seed % 2 == 1;
    return (loud ? "ABCDEF" : "abcdef")[step % 6];
  });
  auto body = [](json extra) {
    json j = {{"model", "demo-moe"}, {"prompt", "x = "}, {"max_tokens", 3}, {"seed", 100}};
    j.update(extra);
    return j;
  };
  json e = json::parse(post(gw, "/v1/completions", body({{"echo", true}})).body);
  CHECK(e["choices"][0]["text"] == "x = abc");
  CHECK(e["usage"]["completion_tokens"] == 3);
  auto s = post(gw, "/v1/completions", body({{"echo", true}, {"stream", true}}));
  std::string streamed;
  for (const json& ev : events_json(s))
    for (const json& c : ev["choices"]) streamed += c.value("text", "");
  CHECK(streamed == "x = abc");

  json b = json::parse(post(gw, "/v1/completions", body({{"n", 2}, {"best_of", 4}})).body);
  REQUIRE(b["choices"].size() == 2);
  CHECK(b["choices"][0]["index"] == 0);
  CHECK(b["choices"][1]["index"] == 1);
  CHECK(b["choices"][0]["text"] == "abc");  // seeds 100 and 102: the quiet ones
  CHECK(b["choices"][1]["text"] == "abc");
  CHECK(b["usage"]["completion_tokens"] == 12);  // every candidate's tokens
  CHECK(b["choices"][0]["logprobs"].is_null());  // ranked by them, not asked for
  CHECK(gw.scheduler().submitted().back().sampling.logprobs);
  json one = json::parse(post(gw, "/v1/completions", body({{"best_of", 3}, {"seed", 101}})).body);
  REQUIRE(one["choices"].size() == 1);
  CHECK(one["choices"][0]["text"] == "abc");  // seed 102 among 101, 102, 103

  check_error(post(gw, "/v1/completions", body({{"echo", true}, {"logprobs", 1}})), 400, "echo", "unsupported_parameter");
  check_error(post(gw, "/v1/completions", body({{"n", 3}, {"best_of", 2}})), 400, "best_of", "invalid_value");
  check_error(post(gw, "/v1/completions", body({{"best_of", 2}, {"stream", true}})), 400, "best_of", "invalid_value");
  check_error(post(gw, "/v1/completions", body({{"best_of", "2"}})), 400, "best_of", "invalid_type");
}

TEST_CASE("api: a chat longer than the context loses its oldest turns, and says so", "[gateway][api][context]") {
  TestGateway gw;
  gw.scheduler().max_context_ = 200;
  // ByteCodec renders "<role>: <content>\n" per message, then "assistant:".
  json msgs = json::array({{{"role", "system"}, {"content", "Be brief."}}});
  for (int i = 0; i < 10; ++i) {
    msgs.push_back({{"role", i % 2 ? "assistant" : "user"}, {"content", "turn " + std::to_string(i) + std::string(20, 'x')}});
  }
  msgs.push_back({{"role", "user"}, {"content", "the last question"}});
  json body = {{"model", "demo-moe"}, {"messages", msgs}, {"max_tokens", 20}};
  auto r = post(gw, "/v1/chat/completions", body);
  INFO(r.body);
  REQUIRE(r.status == 200);
  std::string prompt;
  const auto submitted = gw.scheduler().submitted();
  for (int32_t id : submitted.back().prompt) prompt += char(id);
  CHECK(prompt.size() <= 180);  // room left for the 20 tokens asked
  CHECK(prompt.rfind("system: Be brief.\n", 0) == 0);  // the system turn kept
  CHECK(prompt.find("the last question") != std::string::npos);
  CHECK(prompt.find("turn 0") == std::string::npos);  // the oldest turns gone
  CHECK(prompt.find("turn 9") != std::string::npos);  // the newest kept
  json j = json::parse(r.body);
  REQUIRE(j["usage"].contains("prompt_trimmed"));
  const int dropped = j["usage"]["prompt_trimmed"]["messages"];
  CHECK(dropped >= 1);
  CHECK(dropped <= 10);
  CHECK(prompt.find("turn " + std::to_string(dropped - 1)) == std::string::npos);
  CHECK(prompt.find("turn " + std::to_string(dropped)) != std::string::npos);  // exactly the oldest `dropped`
  CHECK(r.headers["x-moe-context-trimmed"] == "messages=" + std::to_string(dropped) + ", tokens=" +
                                                  std::to_string(j["usage"]["prompt_trimmed"]["tokens"].get<int64_t>()));
  // Streams say it too (the header, and the usage chunk).
  body["stream"] = true;
  body["stream_options"] = {{"include_usage", true}};
  auto s = post(gw, "/v1/chat/completions", body);
  CHECK(s.headers.count("x-moe-context-trimmed") == 1);
  // A chat that fits is left whole, with no trace of the policy.
  auto small = post(gw, "/v1/chat/completions", chat("hi", {{"max_tokens", 5}}));
  CHECK(small.headers.count("x-moe-context-trimmed") == 0);
  CHECK_FALSE(json::parse(small.body)["usage"].contains("prompt_trimmed"));
  // The last message alone too long: still the 400 it always was.
  check_error(post(gw, "/v1/chat/completions", chat(std::string(300, 'y'))), 400, "messages", "context_length_exceeded");
  // truncate_prompt_tokens keeps a prompt's last k tokens.
  auto t = post(gw, "/v1/completions", {{"model", "demo-moe"}, {"prompt", "0123456789abcdef"}, {"max_tokens", 2},
                                        {"truncate_prompt_tokens", 6}});
  REQUIRE(t.status == 200);
  std::string kept;
  const auto after = gw.scheduler().submitted();
  for (int32_t id : after.back().prompt) kept += char(id);
  CHECK(kept == "abcdef");
  CHECK(json::parse(t.body)["usage"]["prompt_trimmed"]["tokens"] == 10);
  check_error(post(gw, "/v1/completions", {{"model", "demo-moe"}, {"prompt", "x"}, {"truncate_prompt_tokens", 0}}), 400,
              "truncate_prompt_tokens", "invalid_value");
}

TEST_CASE("api: a KV cache smaller than the context trims a chat to what it holds, refuses a longer prompt",
          "[gateway][api][context]") {
  TestGateway gw;
  gw.scheduler().max_context_ = 4096;
  gw.scheduler().kv_capacity_ = 120;  // the worker's whole cache: 120 tokens of one sequence
  json msgs = json::array();
  for (int i = 0; i < 10; ++i)
    msgs.push_back({{"role", i % 2 ? "assistant" : "user"}, {"content", "turn " + std::to_string(i) + std::string(20, 'x')}});
  msgs.push_back({{"role", "user"}, {"content", "the last question"}});
  auto r = post(gw, "/v1/chat/completions", {{"model", "demo-moe"}, {"messages", msgs}, {"max_tokens", 10}});
  INFO(r.body);
  REQUIRE(r.status == 200);
  std::string prompt;
  const auto submitted = gw.scheduler().submitted();
  for (int32_t id : submitted.back().prompt) prompt += char(id);
  CHECK(prompt.size() <= 110);  // the cache, less the 10 tokens asked
  CHECK(prompt.find("the last question") != std::string::npos);
  CHECK(json::parse(r.body)["usage"].contains("prompt_trimmed"));
  // Without max_tokens the room kept is an eighth of the cache.
  auto d = post(gw, "/v1/chat/completions", {{"model", "demo-moe"}, {"messages", msgs}});
  REQUIRE(d.status == 200);
  CHECK(gw.scheduler().submitted().back().prompt.size() <= 105);
  // A completion prompt longer than the cache: 400, not a failure later.
  check_error(post(gw, "/v1/completions", {{"model", "demo-moe"}, {"prompt", std::string(121, 'p')}, {"max_tokens", 2}}),
              400, "prompt", "context_length_exceeded");
  // One that fills it exactly runs (its first token fits; it ends there with length).
  CHECK(post(gw, "/v1/completions", {{"model", "demo-moe"}, {"prompt", std::string(120, 'p')}, {"max_tokens", 2}}).status ==
        200);
}

TEST_CASE("api: /v1/models lists the served model", "[gateway][api]") {
  TestGateway gw;
  auto r = http(gw.port(), "GET", "/v1/models");
  json j = json::parse(r.body);
  CHECK(j["object"] == "list");
  REQUIRE(j["data"].size() == 1);
  CHECK(j["data"][0]["id"] == "demo-moe");
  CHECK(j["data"][0]["object"] == "model");
  auto one = json::parse(http(gw.port(), "GET", "/v1/models/demo-moe").body);
  CHECK(one["id"] == "demo-moe");
}

TEST_CASE("api: /health is 503 until the scheduler is ready, and requests are refused", "[gateway][api]") {
  TestGateway gw;
  gw.scheduler().ready_ = false;
  auto h = http(gw.port(), "GET", "/health");
  CHECK(h.status == 503);
  auto refused = post(gw, "/v1/chat/completions", chat("x"));
  check_error(refused, 503, nullptr, "engine_not_ready");
  CHECK(refused.headers["retry-after"] == "1");
  gw.scheduler().ready_ = true;
  CHECK(http(gw.port(), "GET", "/health").status == 200);
  CHECK(json::parse(http(gw.port(), "GET", "/health").body)["status"] == "ok");
  CHECK(json::parse(http(gw.port(), "GET", "/health").body)["redis"].is_null());  // no --redis
}

TEST_CASE("api: degraded serving is marked with X-Moe-Degraded", "[gateway][api]") {
  TestGateway gw;
  gw.scheduler().degraded_ = true;
  auto r = post(gw, "/v1/chat/completions", chat("x"));
  CHECK(r.headers["x-moe-degraded"] == "1");
  auto s = post(gw, "/v1/chat/completions", chat("x", {{"stream", true}}));
  CHECK(s.headers["x-moe-degraded"] == "1");
  auto m = http(gw.port(), "GET", "/metrics").body;
  CHECK(m.find("\nmoe_gateway_degraded 1\n") != std::string::npos);
  CHECK(m.find("\nmoe_gateway_degraded_responses_total 2\n") != std::string::npos);
}

TEST_CASE("api: /metrics is Prometheus text with the gateway's series", "[gateway][api][metrics]") {
  TestGateway gw;
  post(gw, "/v1/chat/completions", chat("hi", {{"max_tokens", 4}}));
  post(gw, "/v1/chat/completions", chat("hi", {{"max_tokens", 0}}));
  auto r = http(gw.port(), "GET", "/metrics");
  REQUIRE(r.status == 200);
  CHECK(r.headers["content-type"].rfind("text/plain; version=0.0.4", 0) == 0);
  const std::string& m = r.body;
  CHECK(m.find("moe_gateway_requests_total{endpoint=\"/v1/chat/completions\",status=\"200\"} 1\n") != std::string::npos);
  CHECK(m.find("moe_gateway_requests_total{endpoint=\"/v1/chat/completions\",status=\"400\"} 1\n") != std::string::npos);
  CHECK(m.find("\nmoe_gateway_completion_tokens_total 4\n") != std::string::npos);
  CHECK(m.find("\nmoe_gateway_prompt_tokens_total 19\n") != std::string::npos);
  CHECK(m.find("\nmoe_gateway_time_to_first_token_seconds_count 1\n") != std::string::npos);
  CHECK(m.find("\nmoe_gateway_inter_token_latency_seconds_count 3\n") != std::string::npos);
  CHECK(m.find("moe_gateway_time_to_first_token_seconds_bucket{le=\"+Inf\"} 1\n") != std::string::npos);
  CHECK(m.find("\nmoe_gateway_kv_blocks_total 64\n") != std::string::npos);
  CHECK(m.find("\nmoe_gateway_preemptions_total 3\n") != std::string::npos);
  CHECK(m.find("\nmoe_gateway_sequences_running 0\n") != std::string::npos);
  CHECK(m.find("\nmoe_gateway_sequences_waiting 0\n") != std::string::npos);
  CHECK(m.find("\nmoe_gateway_degraded 0\n") != std::string::npos);
  // Every line is a comment or "name{labels} value".
  size_t pos = 0;
  while (pos < m.size()) {
    size_t e = m.find('\n', pos);
    REQUIRE(e != std::string::npos);
    std::string line = m.substr(pos, e - pos);
    INFO(line);
    if (line.rfind("# ", 0) != 0) {
      size_t sp = line.rfind(' ');
      REQUIRE(sp != std::string::npos);
      CHECK(line.substr(0, sp).rfind("moe_gateway_", 0) == 0);
      std::string value = line.substr(sp + 1);
      char* end = nullptr;
      std::strtod(value.c_str(), &end);
      CHECK(*end == '\0');
    }
    pos = e + 1;
  }
}

TEST_CASE("api: a client disconnect cancels its sequences at once", "[gateway][api][cancel]") {
  TestGateway gw;
  gw.scheduler().set_script([](const SequenceRequest&, int) { return int32_t{'y'}; });  // never ends
  gw.scheduler().tick_ms_ = 5;
  SECTION("streaming") {
    TestClient c(gw.port());
    std::string body = chat("x", {{"stream", true}, {"n", 2}}).dump();
    c.send("POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: " + std::to_string(body.size()) + "\r\n\r\n" + body);
    c.read_until("\"content\":\"y\"");
    REQUIRE(gw.scheduler().active() == 2);
    c.close();
  }
  SECTION("whole response") {
    TestClient c(gw.port());
    std::string body = chat("x").dump();
    c.send("POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: " + std::to_string(body.size()) + "\r\n\r\n" + body);
    REQUIRE(eventually([&] { return gw.scheduler().active() == 1; }));
    c.close();
  }
  auto t0 = std::chrono::steady_clock::now();
  REQUIRE(eventually([&] { return gw.scheduler().active() == 0; }));
  auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - t0).count();
  CHECK(ms < 500);
  CHECK_FALSE(gw.scheduler().cancelled().empty());
  auto m = http(gw.port(), "GET", "/metrics").body;
  CHECK(m.find("\nmoe_gateway_client_disconnects_total 1\n") != std::string::npos);
}

TEST_CASE("api: an engine failure mid-generation is a clear error", "[gateway][api]") {
  TestGateway gw;
  gw.scheduler().set_script([](const SequenceRequest&, int step) { return step < 2 ? int32_t{'o'} : int32_t{-1}; });
  auto r = post(gw, "/v1/chat/completions", chat("x"));
  check_error(r, 500, nullptr, "engine_error");
  auto s = post(gw, "/v1/chat/completions", chat("x", {{"stream", true}}));
  auto ev = sse_events(s.body);
  REQUIRE(ev.size() >= 2);
  CHECK(ev.back() == "[DONE]");
  json err = json::parse(ev[ev.size() - 2]);
  CHECK(err["error"]["type"] == "server_error");
}
