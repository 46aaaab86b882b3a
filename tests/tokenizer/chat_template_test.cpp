// Chat templates: rendered text must equal what transformers' apply_chat_template
// produced for the reference fixtures, and what Jinja2 (configured the same
// way) produced for the cases in chat_template_cases.json; errors must come
// back as values with a line number; runaway templates must stop.

#include <unistd.h>

#include <catch2/catch.hpp>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>

#include "tokenizer/chat_template.h"

namespace fs = std::filesystem;
using moe::ChatTemplate;
using nlohmann::json;
using nlohmann::ordered_json;

namespace {

const std::string kData = MOE_TEST_DATA;
const std::string kFixtures = kData + "/fixtures";
const std::string kHere = fs::path(__FILE__).parent_path().string();

template <typename Json = json>
Json read_json(const std::string& path) {
  std::ifstream f(path);
  REQUIRE(f.good());
  return Json::parse(f);
}

std::string read_text(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  REQUIRE(f.good());
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

ChatTemplate parse_ok(const std::string& source) {
  auto t = ChatTemplate::parse(source);
  INFO(source);
  if (!t) FAIL("parse failed: " << t.error());
  return *t;
}

std::string render_ok(const std::string& source, const json& messages = json::array(),
                      bool add_generation_prompt = false, const json& extra = json::object()) {
  auto r = parse_ok(source).render(messages, add_generation_prompt, extra);
  INFO(source);
  if (!r) FAIL("render failed: " << r.error());
  return *r;
}

std::string render_error(const std::string& source, const json& messages = json::array()) {
  auto t = ChatTemplate::parse(source);
  if (!t) return t.error();
  auto r = t->render(messages, false);
  INFO(source);
  REQUIRE_FALSE(r.ok());
  return r.error();
}

const json kTwoTurns = json::parse(R"([{"role": "system", "content": "Be brief."},
  {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}])");

}  // namespace

// ---- reference data from transformers -------------------------------------------

TEST_CASE("tokenizer fixtures: every reference chat renders byte-identical to apply_chat_template",
          "[chat_template]") {
  json ref = read_json(kFixtures + "/tokenizers/reference.json");
  int checked = 0;
  for (const char* name : {"bytelevel_qwen", "bytelevel_gpt2", "spm_bpe"}) {
    auto t = moe::load_chat_template(kFixtures + "/tokenizers/" + name);
    INFO(name);
    REQUIRE(t.ok());
    REQUIRE(ref[name]["chats"].size() > 0);
    for (const auto& chat : ref[name]["chats"]) {
      // The reference prompts end ready for the assistant: rendered with add_generation_prompt.
      auto r = t->render(chat["messages"], /*add_generation_prompt=*/true);
      REQUIRE(r.ok());
      CHECK(*r == chat["text"].get<std::string>());
      ++checked;
    }
  }
  CHECK(checked == 6);
}

TEST_CASE(
    "model fixtures: templates from tokenizer_config.json and chat_template.jinja reproduce the "
    "chat prompts",
    "[chat_template]") {
  // The chat prompts of each model's reference.json were rendered from the
  // same two conversations as the tokenizer fixtures' chats.
  json tok_ref = read_json(kFixtures + "/tokenizers/reference.json");
  const json& conversations = tok_ref["bytelevel_qwen"]["chats"];
  int checked = 0;
  for (const char* model :
       {"qwen2_moe", "mixtral", "olmoe", "qwen2_dense", "qwen3_moe", "deepseek_v2"}) {
    INFO(model);
    auto t = moe::load_chat_template(kFixtures + "/" + model);
    if (!t) FAIL(t.error());
    json ref = read_json(kFixtures + "/" + model + "/reference.json");
    int chat_index = 0;
    for (const auto& prompt : ref["prompts"]) {
      if (!prompt["chat"].get<bool>()) continue;
      REQUIRE(chat_index < static_cast<int>(conversations.size()));
      auto r = t->render(conversations[chat_index++]["messages"], true);
      REQUIRE(r.ok());
      CHECK(*r == prompt["text"].get<std::string>());
      ++checked;
    }
    for (const auto& chat : ref.value("chats", json::array())) {
      auto r = t->render(chat["messages"], chat.value("add_generation_prompt", true));
      REQUIRE(r.ok());
      CHECK(*r == chat["text"].get<std::string>());
      ++checked;
    }
  }
  CHECK(checked == 12);
}

TEST_CASE("the demo model's template renders as the reference Qwen-style prompts",
          "[chat_template]") {
  auto t = moe::load_chat_template(kData + "/../../models/demo-moe");
  if (!t) FAIL(t.error());
  CHECK(t->eos_token() == "<|endoftext|>");
  CHECK(t->bos_token().empty());
  json ref = read_json(kFixtures + "/tokenizers/reference.json");
  for (const auto& chat : ref["bytelevel_qwen"]["chats"]) {
    auto r = t->render(chat["messages"], true);
    REQUIRE(r.ok());
    CHECK(*r == chat["text"].get<std::string>());
  }
}

TEST_CASE("special tokens come from tokenizer_config.json, as strings or {content} objects",
          "[chat_template]") {
  auto gpt2 = moe::load_chat_template(kFixtures + "/tokenizers/bytelevel_gpt2");
  REQUIRE(gpt2.ok());
  CHECK(gpt2->bos_token() == "<|endoftext|>");
  auto mixtral = moe::load_chat_template(kFixtures + "/mixtral");
  REQUIRE(mixtral.ok());
  CHECK(mixtral->bos_token() == "<s>");
  CHECK(mixtral->eos_token() == "</s>");

  fs::path dir =
      fs::temp_directory_path() / ("moe_chat_template_test_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  {
    std::ofstream(dir / "tokenizer_config.json") << R"({
      "bos_token": {"content": "<B>", "lstrip": false}, "eos_token": {"content": "<E>"},
      "chat_template": [{"name": "tool_use", "template": "tools"},
                        {"name": "default", "template": "{{ bos_token }}{{ messages[0].content }}{{ eos_token }}"}]})";
  }
  auto t = moe::load_chat_template(dir.string());
  REQUIRE(t.ok());
  CHECK(t->bos_token() == "<B>");
  auto r = t->render(json::parse(R"([{"role": "user", "content": "x"}])"), false);
  REQUIRE(r.ok());
  CHECK(*r == "<B>x<E>");
  // extra_context overrides the loaded tokens
  r = t->render(json::parse(R"([{"role": "user", "content": "x"}])"), false,
                json{{"bos_token", "[b]"}});
  REQUIRE(r.ok());
  CHECK(*r == "[b]x<E>");

  {
    std::ofstream(dir / "tokenizer_config.json")
        << R"({"chat_template": [{"name": "rag", "template": "x"}]})";
  }
  auto no_default = moe::load_chat_template(dir.string());
  REQUIRE_FALSE(no_default.ok());
  CHECK(no_default.error().find("default") != std::string::npos);

  fs::remove_all(dir);
  auto missing = moe::load_chat_template(dir.string());
  REQUIRE_FALSE(missing.ok());
  CHECK(missing.error().find("no chat template") != std::string::npos);
}

// ---- differential cases against Jinja2 ----------------------------------------------

TEST_CASE("language cases match Jinja2 configured as apply_chat_template", "[chat_template]") {
  auto doc = read_json<ordered_json>(kHere + "/chat_template_cases.json");
  int passed = 0, total = 0;
  for (const auto& c : doc["cases"]) {
    const std::string name = c["name"];
    INFO("case " << name);
    std::string source =
        c.contains("template_file")
            ? read_text(kHere + "/chat_templates/" + c["template_file"].get<std::string>())
            : c["template"].get<std::string>();
    ++total;
    auto t = ChatTemplate::parse(source);
    if (!t) {
      CHECK(c.contains("error"));
      if (c.contains("error")) ++passed;
      INFO("parse error: " << t.error());
      continue;
    }
    auto r = t->render_ordered(c["messages"], c["add_generation_prompt"].get<bool>(), c["context"]);
    if (c.contains("text")) {
      if (!r)
        FAIL_CHECK("render failed: " << r.error());
      else {
        CHECK(*r == c["text"].get<std::string>());
        if (*r == c["text"].get<std::string>()) ++passed;
      }
    } else {
      CHECK_FALSE(r.ok());
      const std::string want = c["error"];
      if (!r && !want.empty())
        CHECK(r.error() == want);  // raise_exception: the author's message, verbatim
      if (!r && (want.empty() || r.error() == want)) ++passed;
    }
  }
  INFO(passed << " of " << total << " cases");
  CHECK(total > 100);
  CHECK(passed == total);
}

// ---- the language, case by case -----------------------------------------------------

TEST_CASE("loops expose loop.* and filter with an inline if", "[chat_template]") {
  CHECK(render_ok("{% for m in messages if m.role != 'system' %}{{ loop.index }}{{ m.role[0] }}{{ "
                  "'.' if not loop.last }}"
                  "{% endfor %}",
                  kTwoTurns) == "1u.2a");
  CHECK(render_ok("{% for x in 'abc' %}{{ loop.revindex }}{{ x }}{% endfor %}") == "3a2b1c");
  CHECK(render_ok("{% for x in [] %}a{% else %}none{% endfor %}") == "none");
}

TEST_CASE("namespace() carries values out of a loop; plain set does not", "[chat_template]") {
  const std::string src =
      "{% set ns = namespace(found=false) %}{% set plain = false %}"
      "{% for m in messages %}{% if m.role == 'assistant' %}{% set ns.found = true %}{% set plain "
      "= true %}{% endif %}"
      "{% endfor %}{{ ns.found }}/{{ plain }}";
  CHECK(render_ok(src, kTwoTurns) == "True/False");
  CHECK(render_error("{% set x = 1 %}{% set x.y = 2 %}").find("non-namespace") !=
        std::string::npos);
}

TEST_CASE("whitespace control: -, trim_blocks, lstrip_blocks and a dropped final newline",
          "[chat_template]") {
  CHECK(render_ok("a\n  {%- if true %}\n  b\n  {% endif %}\nc\n") == "a  b\nc");
  CHECK(render_ok("{{ 'x' }}\n{{- 'y' -}}\n  z") == "xyz");
  CHECK(render_ok("  {%+ if true %}k{% endif +%}\nz\n") == "  k\nz");
}

TEST_CASE("undefined names are falsy, print empty and fail only when used as values",
          "[chat_template]") {
  CHECK(render_ok("[{{ nothing }}]{% if not nothing %}f{% endif %}{{ nothing is defined }}{{ "
                  "nothing | length }}") == "[]fFalse0");
  CHECK(render_error("{{ nothing.attr }}") == "chat template line 1: 'nothing' is undefined");
  // tools and documents default to none, as transformers passes them
  CHECK(render_ok("{{ tools is none }}{{ documents is none }}") == "TrueTrue");
}

TEST_CASE("raise_exception() ends the render with the template's own message", "[chat_template]") {
  auto t = parse_ok(
      "{% if messages | length > 1 %}{{ raise_exception('Only one message, please.') }}{% endif "
      "%}ok");
  auto r = t.render(kTwoTurns, false);
  REQUIRE_FALSE(r.ok());
  CHECK(r.error() == "Only one message, please.");
  auto fine = t.render(json::parse(R"([{"role":"user","content":"x"}])"), false);
  REQUIRE(fine.ok());
  CHECK(*fine == "ok");
}

TEST_CASE("syntax errors name the line", "[chat_template]") {
  auto err = [](const std::string& src) {
    auto t = ChatTemplate::parse(src);
    REQUIRE_FALSE(t.ok());
    return t.error();
  };
  CHECK(err("line one\n{% if x %}\n{% frobnicate %}\n{% endif %}") ==
        "chat template line 3: unknown tag 'frobnicate'");
  CHECK(err("a\nb\n{{ x | no_such_filter }}") ==
        "chat template line 3: unknown filter 'no_such_filter'");
  CHECK(err("{% for x in y %}\n\nbody") ==
        "chat template line 3: unexpected end of template: 'for' opened on line 1 is never closed "
        "with 'endfor'");
  CHECK(err("\n\n\n{{ 'unterminated }}").find("chat template line 4: unterminated string") == 0);
  CHECK(err("{{ 1 + }}").find("chat template line 1: expected an expression") == 0);
  CHECK(err("{% endif %}").find("line 1: unexpected 'endif'") != std::string::npos);
  CHECK(err("{% include 'other.jinja' %}").find("not supported") != std::string::npos);
  CHECK(err("{# never closed").find("missing end of comment") != std::string::npos);
  CHECK(err("{% break %}").find("outside of a loop") != std::string::npos);
}

TEST_CASE("runtime errors name the line and never abort", "[chat_template]") {
  CHECK(render_error("ok\n{{ 'a' + 1 }}") ==
        "chat template line 2: unsupported operand type(s) for +: 'str' and 'int'");
  CHECK(render_error("\n{{ 1 // 0 }}").find("line 2") != std::string::npos);
  CHECK(render_error("{% set l = [] %}{{ l.append(1) }}").find("unsafe") != std::string::npos);
  CHECK(render_error("{% for x in none %}{% endfor %}").find("not iterable") != std::string::npos);
  auto t = parse_ok("{{ messages }}");
  CHECK_FALSE(t.render(json::object(), false).ok());  // messages must be a list
}

TEST_CASE("deep nesting and runaway templates are refused with errors", "[chat_template]") {
  // Nesting the parser would otherwise recurse into without bound.
  CHECK(ChatTemplate::parse("{{ " + std::string(5000, '(') + "1" + std::string(5000, ')') + " }}")
            .error()
            .find("nested too deeply") != std::string::npos);
  std::string chain = "{{ 1";
  for (int i = 0; i < 5000; ++i) chain += " + 1";
  CHECK(ChatTemplate::parse(chain + " }}").error().find("nested too deeply") != std::string::npos);
  std::string blocks;
  for (int i = 0; i < 1000; ++i) blocks += "{% if true %}";
  CHECK(ChatTemplate::parse(blocks).error().find("nested too deeply") != std::string::npos);
  CHECK(ChatTemplate::parse("{{ " + std::string(5000, '-') + "1 }}")
            .error()
            .find("nested too deeply") != std::string::npos);

  // Infinite recursion through a macro.
  CHECK(render_error("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}")
            .find("nested too deeply") != std::string::npos);
  // Values nested by a loop cannot grow deeper than printing can handle.
  CHECK(render_error("{% set ns = namespace(x=[]) %}{% for i in range(5000) %}{% set ns.x = [ns.x] "
                     "%}{% endfor %}"
                     "{{ ns.x }}")
            .find("nested too deeply") != std::string::npos);

  // A huge loop stops at the step budget, quickly (CPU time: the machine may be busy).
  const std::clock_t start = std::clock();
  CHECK(render_error(
            "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}")
            .find("ran too long") != std::string::npos);
  // Output that would grow without bound stops at the size limit.
  CHECK(render_error("{% for i in range(100000) %}{{ 'x' * 1000000 }}{% endfor %}")
            .find("too large") != std::string::npos);
  CHECK(render_error("{{ 'x' * 100000000000 }}").find("too large") != std::string::npos);
  CHECK(render_error("{{ range(1000000) | length }}").find("range too big") != std::string::npos);
  const double cpu_seconds = static_cast<double>(std::clock() - start) / CLOCKS_PER_SEC;
  CHECK(cpu_seconds < 10.0);
}

TEST_CASE("render_ordered keeps the key order of tool schemas in tojson", "[chat_template]") {
  auto t = parse_ok("{% for t in tools %}{{ t | tojson }}{% endfor %}");
  ordered_json tools =
      ordered_json::parse(R"([{"name": "f", "parameters": {"type": "object", "a": 1}}])");
  auto r = t.render_ordered(ordered_json::array(), false, ordered_json{{"tools", tools}});
  REQUIRE(r.ok());
  CHECK(*r == R"({"name": "f", "parameters": {"type": "object", "a": 1}})");
}

TEST_CASE("a parsed template renders many times, and copies share it", "[chat_template]") {
  auto t = parse_ok("{{ messages | length }}{{ add_generation_prompt }}");
  ChatTemplate copy = t;
  for (int i = 0; i < 3; ++i) {
    auto r = copy.render(kTwoTurns, i % 2 == 0);
    REQUIRE(r.ok());
    CHECK(*r == (i % 2 == 0 ? "3True" : "3False"));
  }
  CHECK(copy.source() == t.source());
}

TEST_CASE("strftime_now formats the current local time", "[chat_template]") {
  std::string year = render_ok("{{ strftime_now('%Y') }}");
  REQUIRE(year.size() == 4);
  CHECK(std::stoi(year) >= 2024);
}
