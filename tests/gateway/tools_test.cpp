// Tools through the API with the scripted scheduler: tool calls parsed out of
// Hermes markup (whole and split across tokens), the response's tool_calls
// and finish_reason, streamed deltas, assistant tool_calls and tool turns
// rendered back into the prompt, tool_choice validation and the grammar a
// forced choice installs.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cctype>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "gateway/api/tool_call_parser.h"
#include "gateway/structured/json_grammar.h"
#include "gateway_test_harness.h"

using namespace moe::gw;
using namespace moe::gw::test;
using json = nlohmann::json;

namespace {

ClientResponse post(TestGateway& gw, const std::string& path, const json& body) {
  return http(gw.port(), "POST", path, body.dump());
}

const json kWeather = {{"type", "function"},
                       {"function",
                        {{"name", "get_weather"},
                         {"description", "The weather now"},
                         {"parameters",
                          {{"type", "object"},
                           {"properties", {{"city", {{"type", "string"}}}, {"days", {{"type", "integer"}}}}},
                           {"required", {"city"}}}}}}};
const json kTime = {{"type", "function"}, {"function", {{"name", "get_time"}, {"parameters", {{"type", "object"}}}}}};

json chat_body(json extra) {
  json j = {{"model", "demo-moe"}, {"messages", {{{"role", "user"}, {"content", "weather?"}}}}, {"max_tokens", 200}};
  j.update(extra);
  return j;
}

// A whole value of the grammar `sc`.
bool accepts(const structured::Schema& sc, const std::string& text) {
  auto g = structured::GrammarState::start(sc);
  return g.feed(sc, text) && g.finishable(sc);
}

// The script speaks `text`, byte by byte, then EOS.
ScriptedScheduler::Script speak(std::string text) {
  return [text](const SequenceRequest&, int step) -> int32_t {
    return step < int(text.size()) ? int32_t(uint8_t(text[size_t(step)])) : ByteCodec::kEos;
  };
}

}  // namespace

TEST_CASE("tools: the parser takes calls out of text split anywhere, and leaves what is not a call",
          "[gateway][tools]") {
  const std::string text = "Let me look.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Oslo\"}}\n"
                           "</tool_call>\n<tool_call>\n{\"name\": \"get_time\", \"arguments\": {}}\n</tool_call>";
  for (size_t piece : {size_t(1), size_t(2), size_t(5), size_t(7), text.size()}) {
    INFO("pieces of " << piece);
    ToolCallParser p;
    std::string shown;
    std::vector<ToolCallParser::Call> calls;
    for (size_t at = 0; at < text.size(); at += piece) {
      auto s = p.push(std::string_view(text).substr(at, piece));
      shown += s.text;
      calls.insert(calls.end(), s.calls.begin(), s.calls.end());
    }
    auto end = p.finish();
    shown += end.text;
    calls.insert(calls.end(), end.calls.begin(), end.calls.end());
    CHECK(shown == "Let me look.\n");
    REQUIRE(calls.size() == 2);
    CHECK(calls[0].name == "get_weather");
    CHECK(json::parse(calls[0].arguments) == json{{"city", "Oslo"}});
    CHECK(calls[1].name == "get_time");
    CHECK(calls[1].arguments == "{}");
  }
  ToolCallParser bad;
  auto s = bad.push("a <tool_call>not json</tool_call> b <tool_");
  auto e = bad.finish();
  CHECK(s.text + e.text == "a <tool_call>not json</tool_call> b <tool_");
  CHECK(s.calls.empty());
  ToolCallParser open;  // stopped inside a call: still a call when its JSON is whole
  auto o = open.push("<tool_call>{\"name\": \"f\", \"arguments\": {\"x\": 1}}");
  auto oe = open.finish();
  CHECK(o.text + oe.text == "");
  REQUIRE(oe.calls.size() == 1);
  CHECK(oe.calls[0].name == "f");
}

TEST_CASE("tools: a call becomes tool_calls with finish_reason tool_calls, whole and streamed", "[gateway][tools]") {
  TestGateway gw;
  gw.scheduler().set_script(
      speak("<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Oslo\"}}\n</tool_call>"));
  auto r = post(gw, "/v1/chat/completions", chat_body({{"tools", {kWeather, kTime}}}));
  INFO(r.body);
  REQUIRE(r.status == 200);
  json j = json::parse(r.body);
  const json& m = j["choices"][0]["message"];
  CHECK(m["content"].is_null());
  REQUIRE(m["tool_calls"].size() == 1);
  CHECK(m["tool_calls"][0]["type"] == "function");
  CHECK(m["tool_calls"][0]["function"]["name"] == "get_weather");
  CHECK(json::parse(m["tool_calls"][0]["function"]["arguments"].get<std::string>()) == json{{"city", "Oslo"}});
  CHECK(m["tool_calls"][0]["id"].get<std::string>().rfind("call_", 0) == 0);
  CHECK(j["choices"][0]["finish_reason"] == "tool_calls");
  // The tools reached the template.
  const auto prompt = gw.scheduler().submitted().back().prompt;
  const std::string text(prompt.begin(), prompt.end());
  CHECK(text.find("\"get_time\"") != std::string::npos);

  auto s = post(gw, "/v1/chat/completions", chat_body({{"tools", {kWeather}}, {"stream", true}}));
  std::vector<json> deltas;
  std::string finish, content;
  for (const auto& ev : sse_events(s.body)) {
    if (ev == "[DONE]") continue;
    json c = json::parse(ev)["choices"][0];
    if (c["delta"].contains("tool_calls")) deltas.push_back(c["delta"]["tool_calls"][0]);
    if (c["delta"].contains("content") && c["delta"]["content"].is_string()) content += c["delta"]["content"];
    if (c["finish_reason"].is_string()) finish = c["finish_reason"];
  }
  REQUIRE(deltas.size() == 1);
  CHECK(deltas[0]["index"] == 0);
  CHECK(deltas[0]["function"]["name"] == "get_weather");
  CHECK(content.empty());
  CHECK(finish == "tool_calls");

  // tool_choice none: the markup stays text.
  auto n = json::parse(post(gw, "/v1/chat/completions", chat_body({{"tools", {kWeather}}, {"tool_choice", "none"}})).body);
  CHECK(n["choices"][0]["message"]["content"].get<std::string>().find("<tool_call>") == 0);
  CHECK(n["choices"][0]["finish_reason"] == "stop");
}

TEST_CASE("tools: assistant tool_calls and tool turns are rendered back; bad shapes are 400", "[gateway][tools]") {
  TestGateway gw;
  json msgs = {{{"role", "user"}, {"content", "weather?"}},
               {{"role", "assistant"},
                {"content", nullptr},
                {"tool_calls",
                 {{{"id", "call_1"}, {"type", "function"},
                   {"function", {{"name", "get_weather"}, {"arguments", "{\"city\": \"Oslo\"}"}}}}}}},
               {{"role", "tool"}, {"tool_call_id", "call_1"}, {"content", "{\"temp\": 3}"}}};
  auto r = post(gw, "/v1/chat/completions", chat_body({{"tools", {kWeather}}, {"messages", msgs}}));
  REQUIRE(r.status == 200);
  const auto prompt = gw.scheduler().submitted().back().prompt;
  const std::string text(prompt.begin(), prompt.end());
  CHECK(text.find("calls [{\"function\":{\"arguments\":\"{\\\"city\\\": \\\"Oslo\\\"}\",\"name\":\"get_weather\"}") !=
        std::string::npos);
  CHECK(text.find("tool: {\"temp\": 3} answers call_1") != std::string::npos);

  auto err = [&](json extra, const char* param, const char* code) {
    INFO(extra.dump());
    auto e = post(gw, "/v1/chat/completions", chat_body(extra));
    CHECK(e.status == 400);
    json j = json::parse(e.body);
    CHECK(j["error"]["param"] == param);
    CHECK(j["error"]["code"] == code);
  };
  err({{"tools", "x"}}, "tools", "invalid_type");
  err({{"tools", {{{"type", "function"}, {"function", {{"name", "bad name"}}}}}}}, "tools[0].function.name", "invalid_value");
  err({{"tools", {kWeather, kWeather}}}, "tools[1].function.name", "invalid_value");
  // Arguments are an object: a schema of a string or an integer is refused.
  for (const char* type : {"string", "integer"})
    err({{"tools", {{{"type", "function"}, {"function", {{"name", "f"}, {"parameters", {{"type", type}}}}}}}}},
        "tools[0].function.parameters", "invalid_value");
  err({{"tool_choice", "required"}}, "tool_choice", "invalid_value");  // no tools
  err({{"tools", {kWeather}}, {"tool_choice", {{"type", "function"}, {"function", {{"name", "nope"}}}}}}, "tool_choice",
      "invalid_value");
  err({{"tools", {kWeather}}, {"tool_choice", "sometimes"}}, "tool_choice", "invalid_value");
  err({{"messages", {{{"role", "user"}, {"content", "x"}, {"tool_calls", json::array()}}}}}, "messages[0].tool_calls",
      "invalid_value");
}

TEST_CASE("tools: a forced choice installs a grammar of the call, in the model's markup", "[gateway][tools]") {
  TestGateway gw;
  gw.scheduler().set_script(speak("<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"x\"}}\n</tool_call>"));
  auto r = post(gw, "/v1/chat/completions",
                chat_body({{"tools", {kWeather, kTime}},
                           {"tool_choice", {{"type", "function"}, {"function", {{"name", "get_weather"}}}}}}));
  REQUIRE(r.status == 200);
  const SequenceRequest sub = gw.scheduler().submitted().back();
  REQUIRE(sub.grammar);
  const auto& sc = sub.grammar->schema();
  CHECK(accepts(sc, "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Oslo\", \"days\": 2}}\n</tool_call>"));
  CHECK_FALSE(accepts(sc, "<tool_call>\n{\"name\": \"get_time\", \"arguments\": {}}\n</tool_call>"));  // not the named one
  CHECK_FALSE(accepts(sc, "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"days\": 2}}\n</tool_call>"));  // city
  CHECK_FALSE(accepts(sc, "Sure! <tool_call>"));
  CHECK_FALSE(accepts(sc, "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"a\"}}\n</tool_call>\n<tool_call>"));
  // required, parallel: any of the tools, one call or more.
  post(gw, "/v1/chat/completions", chat_body({{"tools", {kWeather, kTime}}, {"tool_choice", "required"}}));
  const SequenceRequest any = gw.scheduler().submitted().back();
  REQUIRE(any.grammar);
  const auto& sa = any.grammar->schema();
  auto g = structured::GrammarState::start(sa);
  CHECK(g.feed(sa, "<tool_call>\n{\"name\": \"get_time\", \"arguments\": {}}\n</tool_call>"));
  CHECK(g.finishable(sa));
  CHECK(g.feed(sa, "\n<tool_call>\n{\"arguments\": {\"city\": \"b\"}, \"name\": \"get_weather\"}\n</tool_call>"));
  CHECK(g.finishable(sa));
  // A function declared without parameters takes none: its arguments are {}.
  const json bare = {{"type", "function"}, {"function", {{"name", "ping"}}}};
  post(gw, "/v1/chat/completions",
       chat_body({{"tools", {bare}}, {"tool_choice", {{"type", "function"}, {"function", {{"name", "ping"}}}}}}));
  const SequenceRequest none = gw.scheduler().submitted().back();
  REQUIRE(none.grammar);
  const auto& sn = none.grammar->schema();
  CHECK(accepts(sn, "<tool_call>\n{\"name\": \"ping\", \"arguments\": {}}\n</tool_call>"));
  CHECK_FALSE(accepts(sn, "<tool_call>\n{\"name\": \"ping\", \"arguments\": {\"name\": \"ping\"}}\n</tool_call>"));
  // "required" over more tools than one enum holds (64; a request may hold
  // 128, 70 fit this test model's context): an anyOf of enums, not a 400
  // about an enum.
  json many = json::array();
  for (int i = 0; i < 70; ++i) many.push_back({{"type", "function"}, {"function", {{"name", "f" + std::to_string(i)}}}});
  auto r70 = post(gw, "/v1/chat/completions", chat_body({{"tools", many}, {"tool_choice", "required"}}));
  INFO(r70.body);
  REQUIRE(r70.status == 200);
  const SequenceRequest wide = gw.scheduler().submitted().back();
  REQUIRE(wide.grammar);
  const auto& sw = wide.grammar->schema();
  for (const char* name : {"f0", "f63", "f64", "f69"})
    CHECK(accepts(sw, std::string("<tool_call>\n{\"name\": \"") + name + "\", \"arguments\": {}}\n</tool_call>"));
  CHECK_FALSE(accepts(sw, "<tool_call>\n{\"name\": \"f70\", \"arguments\": {}}\n</tool_call>"));
}

TEST_CASE("tools: Mistral's [TOOL_CALLS] list, parsed at the end; ids of nine characters; a forced call's grammar",
          "[gateway][tools]") {
  ToolCallParser p(ToolCallParser::Markup::mistral);
  const std::string text = "ok [TOOL_CALLS] [{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Oslo\"}}, "
                           "{\"name\": \"get_time\", \"arguments\": {}}]";
  std::string shown;
  for (size_t at = 0; at < text.size(); at += 3) shown += p.push(std::string_view(text).substr(at, 3)).text;
  auto end = p.finish();
  CHECK(shown + end.text == "ok ");
  REQUIRE(end.calls.size() == 2);
  CHECK(end.calls[0].name == "get_weather");
  CHECK(end.calls[1].name == "get_time");
  ToolCallParser bad(ToolCallParser::Markup::mistral);
  auto b = bad.push("[TOOL_CALLS] [not a list");
  auto be = bad.finish();
  CHECK(b.text + be.text == "[TOOL_CALLS] [not a list");

  ByteCodec codec;
  codec.tool_format_ = TextCodec::ToolFormat::mistral;
  TestGateway gw({}, {}, &codec);
  gw.scheduler().set_script(speak("[TOOL_CALLS] [{\"name\": \"get_weather\", \"arguments\": {\"city\": \"x\"}}]"));
  json r = json::parse(post(gw, "/v1/chat/completions", chat_body({{"tools", {kWeather}}})).body);
  const json& m = r["choices"][0]["message"];
  REQUIRE(m["tool_calls"].size() == 1);
  const std::string id = m["tool_calls"][0]["id"];
  CHECK(id.size() == 9);
  CHECK(std::all_of(id.begin(), id.end(), [](char ch) { return std::isalnum(static_cast<unsigned char>(ch)); }));
  CHECK(r["choices"][0]["finish_reason"] == "tool_calls");
  post(gw, "/v1/chat/completions",
       chat_body({{"tools", {kWeather, kTime}}, {"tool_choice", {{"type", "function"}, {"function", {{"name", "get_time"}}}}}}));
  const SequenceRequest sub = gw.scheduler().submitted().back();
  REQUIRE(sub.grammar);
  const auto& sc = sub.grammar->schema();
  CHECK(accepts(sc, "[TOOL_CALLS] [{\"name\": \"get_time\", \"arguments\": {}}]"));
  CHECK_FALSE(accepts(sc, "[TOOL_CALLS] [{\"name\": \"get_time\", \"arguments\": {}}, {\"name\": \"get_time\", \"arguments\": {}}]"));
  CHECK_FALSE(accepts(sc, "[TOOL_CALLS] [{\"name\": \"get_weather\", \"arguments\": {\"city\": \"a\"}}]"));
  CHECK_FALSE(accepts(sc, "[TOOL_CALLS] []"));
}

TEST_CASE("tools: a template that knows no tools refuses tools and an assistant turn's tool calls", "[gateway][tools]") {
  ByteCodec codec;
  codec.tool_format_ = TextCodec::ToolFormat::none;
  TestGateway gw({}, {}, &codec);
  auto r = post(gw, "/v1/chat/completions", chat_body({{"tools", {kWeather}}}));
  CHECK(r.status == 400);
  CHECK(json::parse(r.body)["error"]["param"] == "tools");
  json msgs = {{{"role", "user"}, {"content", "x"}},
               {{"role", "assistant"},
                {"content", nullptr},
                {"tool_calls", {{{"id", "c"}, {"type", "function"}, {"function", {{"name", "f"}, {"arguments", "{}"}}}}}}},
               {{"role", "user"}, {"content", "y"}}};
  auto t = post(gw, "/v1/chat/completions", chat_body({{"messages", msgs}}));
  CHECK(t.status == 400);
  json j = json::parse(t.body);
  CHECK(j["error"]["param"] == "messages[1].tool_calls");
  CHECK(j["error"]["code"] == "unsupported_parameter");
  CHECK(gw.scheduler().submitted().empty());
}
