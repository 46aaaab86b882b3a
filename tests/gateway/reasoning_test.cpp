// A thinking model's chat: <think>…</think> comes back as reasoning_content,
// never inside content, whole and streamed; chat_template_kwargs reach the
// model's template.
#include <catch2/catch.hpp>

#include <filesystem>
#include <fstream>

#include <nlohmann/json.hpp>

#include "gateway/api/model_text_codec.h"
#include "gateway/api/reasoning_splitter.h"
#include "gateway_test_harness.h"
#include "tokenizer/tokenizer.h"

using namespace moe::gw;
using namespace moe::gw::test;
using nlohmann::json;
namespace fs = std::filesystem;

namespace {

// ByteCodec with a thinking model's tags; chat_template_kwargs
// {"open_in_prompt": true} makes the generation prompt end in "<think>\n".
class ThinkingCodec final : public TextCodec {
 public:
  std::vector<int32_t> encode(std::string_view text) const override { return inner_.encode(text); }
  moe::Result<std::vector<int32_t>> encode_chat(const json& messages) const override {
    return inner_.encode_chat(messages);
  }
  moe::Result<std::vector<int32_t>> encode_chat(const json& messages, const json& kwargs) const override {
    auto ids = inner_.encode_chat(messages);
    if (ids.ok() && kwargs.value("open_in_prompt", false))
      for (int32_t b : byte_tokens("<think>\n")) ids.value().push_back(b);
    return ids;
  }
  std::unique_ptr<TokenTextStream> stream_decoder() const override { return inner_.stream_decoder(); }
  std::string token_bytes(int32_t id) const override { return inner_.token_bytes(id); }
  int vocab_size() const override { return inner_.vocab_size(); }
  std::vector<int32_t> stop_token_ids() const override { return inner_.stop_token_ids(); }
  ReasoningTags reasoning_tags() const override { return {"<think>", "</think>"}; }

 private:
  ByteCodec inner_;
};

json chat(json extra = json::object()) {
  json j = {{"model", "demo-moe"}, {"messages", {{{"role", "user"}, {"content", "q"}}}}, {"temperature", 0}};
  j.update(extra);
  return j;
}

// The reasoning and the content a stream's chunks carry, in order; and
// whether any content chunk held a tag.
struct Streamed {
  std::string reasoning, content;
  bool tag_in_content = false;
};
Streamed streamed(const ClientResponse& r) {
  Streamed s;
  for (const auto& ev : sse_events(r.body)) {
    if (ev == "[DONE]") break;
    json j = json::parse(ev);
    if (j["choices"].empty()) continue;
    const json& d = j["choices"][0]["delta"];
    if (d.contains("reasoning_content")) s.reasoning += d["reasoning_content"].get<std::string>();
    if (d.contains("content") && d["content"].is_string()) {
      const std::string c = d["content"];
      s.content += c;
      if (c.find("think>") != std::string::npos) s.tag_in_content = true;
    }
  }
  return s;
}

}  // namespace

TEST_CASE("reasoning splitter: tags across pushes, leading whitespace, no tags, cut inside", "[gateway][reasoning]") {
  auto run = [](const std::string& text, bool inside, size_t step) {
    ReasoningSplitter sp("<think>", "</think>", inside);
    ReasoningSplitter::Parts all;
    for (size_t i = 0; i < text.size(); i += step) {
      auto p = sp.push(text.substr(i, step));
      all.reasoning += p.reasoning;
      all.content += p.content;
    }
    auto p = sp.finish();
    all.reasoning += p.reasoning;
    all.content += p.content;
    return all;
  };
  for (size_t step : {1, 2, 3, 7, 100}) {
    INFO("step " << step);
    auto a = run("<think>\nplan it</think>\n\nThe answer.", false, step);
    CHECK(a.reasoning == "\nplan it");
    CHECK(a.content == "The answer.");
    auto b = run("  \n<think>x</think>y", false, step);
    CHECK(b.reasoning == "x");
    CHECK(b.content == "y");
    auto c = run("No tags <think> here", false, step);  // not at the start: all answer
    CHECK(c.reasoning.empty());
    CHECK(c.content == "No tags <think> here");
    auto d = run("plan</think>answer", true, step);  // the prompt opened it
    CHECK(d.reasoning == "plan");
    CHECK(d.content == "answer");
    auto e = run("<think>never closed </thi", false, step);  // cut by max_tokens
    CHECK(e.reasoning == "never closed </thi");
    CHECK(e.content.empty());
    auto f = run("<thin", false, step);  // shorter than the tag, and not it
    CHECK(f.content == "<thin");
  }
}

TEST_CASE("api: a thinking model's reasoning is reasoning_content, whole and streamed", "[gateway][reasoning]") {
  ThinkingCodec codec;
  TestGateway gw({}, {}, &codec);
  gw.scheduler().set_script(spell("<think>\nLet me see.\n</think>\n\nIt is 4."));
  auto whole = http(gw.port(), "POST", "/v1/chat/completions", chat().dump());
  REQUIRE(whole.status == 200);
  json w = json::parse(whole.body);
  CHECK(w["choices"][0]["message"]["reasoning_content"] == "\nLet me see.\n");
  CHECK(w["choices"][0]["message"]["content"] == "It is 4.");

  auto s = streamed(http(gw.port(), "POST", "/v1/chat/completions", chat({{"stream", true}}).dump()));
  CHECK(s.reasoning == "\nLet me see.\n");
  CHECK(s.content == "It is 4.");
  CHECK_FALSE(s.tag_in_content);

  // The template opened the reasoning in the prompt: the output starts inside it.
  gw.scheduler().set_script(spell("step by step</think>done"));
  auto opened = http(gw.port(), "POST", "/v1/chat/completions",
                     chat({{"chat_template_kwargs", {{"open_in_prompt", true}}}}).dump());
  REQUIRE(opened.status == 200);
  json o = json::parse(opened.body);
  CHECK(o["choices"][0]["message"]["reasoning_content"] == "step by step");
  CHECK(o["choices"][0]["message"]["content"] == "done");

  // No reasoning in the output: no reasoning_content, the whole text is the answer.
  gw.scheduler().set_script(spell("plain"));
  json p = json::parse(http(gw.port(), "POST", "/v1/chat/completions", chat().dump()).body);
  CHECK_FALSE(p["choices"][0]["message"].contains("reasoning_content"));
  CHECK(p["choices"][0]["message"]["content"] == "plain");

  // A close tag without an open one (a template that does not open it): in a
  // whole response the text before it is the reasoning.
  gw.scheduler().set_script(spell("plan</think>\nans"));
  json q = json::parse(http(gw.port(), "POST", "/v1/chat/completions", chat().dump()).body);
  CHECK(q["choices"][0]["message"]["reasoning_content"] == "plan");
  CHECK(q["choices"][0]["message"]["content"] == "ans");
  // ... but not under response_format: the whole text is the value asked for
  // (a JSON string holding "</think>" was cut in two, the JSON with it).
  const std::string value = R"({"tag": "a</think>b"})";
  gw.scheduler().set_script(spell(value));
  json v = json::parse(http(gw.port(), "POST", "/v1/chat/completions",
                            chat({{"response_format", {{"type", "json_object"}}}}).dump())
                           .body);
  CHECK(v["choices"][0]["message"]["content"] == value);
  CHECK_FALSE(v["choices"][0]["message"].contains("reasoning_content"));

  // Logprobs in a stream: every token's once; the answer's ride on answer chunks.
  const std::string out = "<think>r</think>ab";
  gw.scheduler().set_script(spell(out));
  auto lr = http(gw.port(), "POST", "/v1/chat/completions", chat({{"stream", true}, {"logprobs", true}}).dump());
  size_t on_reasoning = 0, on_content = 0;
  std::string answer_tokens;
  for (const auto& ev : sse_events(lr.body)) {
    if (ev == "[DONE]") break;
    json j = json::parse(ev);
    if (j["choices"].empty() || !j["choices"][0]["logprobs"].is_object()) continue;
    const json& entries = j["choices"][0]["logprobs"]["content"];
    const json& d = j["choices"][0]["delta"];
    if (d.contains("reasoning_content")) on_reasoning += entries.size();
    if (d.contains("content")) {
      on_content += entries.size();
      for (const json& e : entries) answer_tokens += e["token"].get<std::string>();
    }
  }
  CHECK(on_reasoning + on_content == out.size());
  CHECK(answer_tokens == "ab");

  // Completions are raw text: nothing is split.
  gw.scheduler().set_script(spell("<think>a</think>b"));
  json c = json::parse(http(gw.port(), "POST", "/v1/completions",
                            json{{"model", "demo-moe"}, {"prompt", "x"}}.dump()).body);
  CHECK(c["choices"][0]["text"] == "<think>a</think>b");
}

TEST_CASE("api: chat_template_kwargs reach the model's template; reserved names are refused", "[gateway][reasoning]") {
  // The demo model with a template that reads enable_thinking as Qwen3's does.
  const fs::path demo = fs::path(MOE_TEST_DATA) / ".." / ".." / "models" / "demo-moe";
  const fs::path dir = fs::temp_directory_path() / ("moe-reasoning-test-" + std::to_string(::getpid()));
  fs::create_directories(dir);
  for (const char* f : {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"})
    fs::copy_file(demo / f, dir / f, fs::copy_options::overwrite_existing);
  fs::remove(dir / "model.safetensors");
  fs::create_symlink(fs::absolute(demo / "model.safetensors"), dir / "model.safetensors");
  std::ofstream(dir / "chat_template.jinja")
      << "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
         "{% if add_generation_prompt %}<|im_start|>assistant\n"
         "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}"
         "{% endif %}";
  auto codec = load_model_text_codec(dir.string());
  REQUIRE(codec.ok());
  CHECK(codec.value()->reasoning_tags().close == "</think>");  // the template writes it
  auto tok = moe::Tokenizer::load_dir(dir.string());
  REQUIRE(tok.ok());
  TestGateway gw({}, {}, codec.value().get());
  gw.scheduler().set_script([](const SequenceRequest&, int) { return 4096; });  // EOS at once
  const std::string base = "<|im_start|>user\nq<|im_end|>\n<|im_start|>assistant\n";
  auto r = http(gw.port(), "POST", "/v1/chat/completions", chat().dump());
  REQUIRE(r.status == 200);
  CHECK(gw.scheduler().submitted().back().prompt == tok.value()->encode(base, false));
  r = http(gw.port(), "POST", "/v1/chat/completions", chat({{"chat_template_kwargs", {{"enable_thinking", false}}}}).dump());
  REQUIRE(r.status == 200);
  CHECK(gw.scheduler().submitted().back().prompt == tok.value()->encode(base + "<think>\n\n</think>\n\n", false));
  auto bad = http(gw.port(), "POST", "/v1/chat/completions",
                  chat({{"chat_template_kwargs", {{"add_generation_prompt", false}}}}).dump());
  CHECK(bad.status == 400);
  CHECK(json::parse(bad.body)["error"]["param"] == "chat_template_kwargs");
  auto bad_type = http(gw.port(), "POST", "/v1/chat/completions", chat({{"chat_template_kwargs", 3}}).dump());
  CHECK(bad_type.status == 400);
  fs::remove_all(dir);
}
