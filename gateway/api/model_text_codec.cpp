#include "gateway/api/model_text_codec.h"

#include <algorithm>
#include <cstdio>
#include <optional>
#include <random>

#include "model/model_files.h"
#include "tokenizer/chat_template.h"
#include "tokenizer/tokenizer.h"

namespace moe::gw {
namespace {

class TokenizerStream final : public TokenTextStream {
 public:
  explicit TokenizerStream(const Tokenizer& tok) : dec_(tok, /*skip_special=*/true) {}
  std::string push(int32_t id) override { return dec_.push(id); }
  std::string flush() override { return dec_.flush(); }

 private:
  StreamDecoder dec_;
};

// The marks around a message's text in a rendered prompt: private-use
// characters around a random nonce, which no client can guess to forge.
std::string open_mark(const std::string& nonce) { return "\xEE\x80\x80" + nonce + "\xEE\x80\x81"; }
std::string close_mark(const std::string& nonce) { return "\xEE\x80\x81" + nonce + "\xEE\x80\x80"; }

class ModelTextCodec final : public TextCodec {
 public:
  ModelTextCodec(std::unique_ptr<Tokenizer> tok, std::optional<ChatTemplate> tmpl, std::vector<int32_t> stop_ids,
                 int model_vocab)
      : tok_(std::move(tok)), tmpl_(std::move(tmpl)), stop_ids_(std::move(stop_ids)), model_vocab_(model_vocab) {}

  std::vector<int32_t> encode(std::string_view text) const override { return tok_->encode(text, true); }

  Result<std::vector<int32_t>> encode_chat(const nlohmann::json& messages) const override {
    return encode_chat(messages, nlohmann::json::object());
  }

  Result<std::vector<int32_t>> encode_chat(const nlohmann::json& messages,
                                           const nlohmann::json& template_kwargs) const override {
    if (!tmpl_) return make_error("the model has no chat template; use /v1/completions");
    // What a message says is text: "<|im_end|>" written in it must not end
    // its turn and open another role's. Only the template writes special
    // tokens. A message holding a special token's text is marked, and its
    // span of the rendered prompt encoded as text (docs/gateway.md).
    nlohmann::json marked;
    const std::string nonce = marked_spans_nonce(messages, marked);
    auto text = tmpl_->render(nonce.empty() ? messages : marked, /*add_generation_prompt=*/true, template_kwargs);
    if (!text.ok()) return make_error(text.error());
    // The template writes the special tokens (BOS included) itself.
    if (nonce.empty()) return tok_->encode(text.value(), false);
    return encode_marked(text.value(), nonce);
  }

  // A copy of `messages` in `marked` with every client string (content, a
  // tool call's arguments) that holds a special token's text between marks,
  // and the marks' nonce; "" (and `marked` untouched) when none does.
  std::string marked_spans_nonce(const nlohmann::json& messages, nlohmann::json& marked) const {
    auto special = [&](const nlohmann::json& v) { return v.is_string() && tok_->has_special_text(v.get_ref<const std::string&>()); };
    bool any = false;
    for (const auto& m : messages) {
      if (!m.is_object()) continue;
      if (m.contains("content") && special(m["content"])) any = true;
      if (m.contains("tool_calls") && m["tool_calls"].is_array())
        for (const auto& c : m["tool_calls"])
          if (c.is_object() && c.contains("function") && c["function"].is_object() &&
              c["function"].contains("arguments") && special(c["function"]["arguments"]))
            any = true;
    }
    if (!any) return {};
    thread_local std::mt19937_64 rng{std::random_device{}()};
    char hex[33];
    std::snprintf(hex, sizeof hex, "%016llx%016llx", static_cast<unsigned long long>(rng()),
                  static_cast<unsigned long long>(rng()));
    const std::string nonce = hex, open = open_mark(nonce), close = close_mark(nonce);
    auto mark = [&](nlohmann::json& v) {
      if (special(v)) v = open + v.get<std::string>() + close;
    };
    marked = messages;
    for (auto& m : marked) {
      if (!m.is_object()) continue;
      if (m.contains("content")) mark(m["content"]);
      if (m.contains("tool_calls") && m["tool_calls"].is_array())
        for (auto& c : m["tool_calls"])
          if (c.is_object() && c.contains("function") && c["function"].is_object() &&
              c["function"].contains("arguments"))
            mark(c["function"]["arguments"]);
    }
    return nonce;
  }

  // A rendered prompt with marked spans: the template's text with its
  // special tokens, each marked span as text.
  Result<std::vector<int32_t>> encode_marked(const std::string& text, const std::string& nonce) const {
    const std::string open = open_mark(nonce), close = close_mark(nonce);
    std::vector<int32_t> ids;
    size_t at = 0;
    while (at <= text.size()) {
      const size_t o = text.find(open, at);
      const size_t plain_end = o == std::string::npos ? text.size() : o;
      if (text.find(close, at) < plain_end)
        return make_error("the chat template cut a message's text apart; it cannot be kept apart from its special tokens");
      const std::vector<int32_t> outside = tok_->encode(std::string_view(text).substr(at, plain_end - at), false);
      ids.insert(ids.end(), outside.begin(), outside.end());
      if (o == std::string::npos) break;
      const size_t start = o + open.size(), c = text.find(close, start);
      const size_t next_open = text.find(open, start);
      if (c == std::string::npos || next_open < c)
        return make_error("the chat template cut a message's text apart; it cannot be kept apart from its special tokens");
      const std::vector<int32_t> inside = tok_->encode_text(std::string_view(text).substr(start, c - start), ids.empty());
      ids.insert(ids.end(), inside.begin(), inside.end());
      at = c + close.size();
    }
    return ids;
  }

  // A template that writes </think> (Qwen3's, DeepSeek-R1's) belongs to a
  // model that thinks in <think>…</think>.
  ReasoningTags reasoning_tags() const override {
    if (tmpl_ && tmpl_->source().find("</think>") != std::string::npos) return {"<think>", "</think>"};
    return {};
  }

  std::unique_ptr<TokenTextStream> stream_decoder() const override { return std::make_unique<TokenizerStream>(*tok_); }

  std::string token_bytes(int32_t id) const override {
    int32_t one[1] = {id};
    return tok_->decode(one, /*skip_special_tokens=*/false);
  }
  std::string token_raw_bytes(int32_t id) const override { return tok_->token_bytes(id); }

  bool is_special(int32_t id) const override { return tok_->is_special(id); }
  // A template that describes tools and writes [TOOL_CALLS] (Mistral's) or <tool_call> (Qwen's, Hermes').
  ToolFormat tool_format() const override {
    if (!tmpl_ || tmpl_->source().find("tools") == std::string::npos) return ToolFormat::none;
    if (tmpl_->source().find("[TOOL_CALLS]") != std::string::npos) return ToolFormat::mistral;
    if (tmpl_->source().find("<tool_call>") != std::string::npos) return ToolFormat::hermes;
    return ToolFormat::none;
  }
  // The ids a request may name: the tokenizer's, and only those the model
  // has rows for where its vocabulary is the smaller.
  int vocab_size() const override {
    return model_vocab_ > 0 ? std::min(tok_->vocab_size(), model_vocab_) : tok_->vocab_size();
  }
  std::vector<int32_t> stop_token_ids() const override { return stop_ids_; }

 private:
  std::unique_ptr<Tokenizer> tok_;
  std::optional<ChatTemplate> tmpl_;
  std::vector<int32_t> stop_ids_;
  int model_vocab_ = 0;
};

}  // namespace

Result<std::unique_ptr<TextCodec>> load_model_text_codec(const std::string& model_path) {
  auto files = ModelFiles::open(model_path);
  if (!files.ok()) return make_error(files.error());
  const ModelFiles& f = *files.value();
  std::string tok_json = f.tokenizer_file("tokenizer.json");
  if (tok_json.empty()) return make_error(model_path + ": no tokenizer.json");
  auto tok = Tokenizer::from_json(tok_json, f.tokenizer_file("tokenizer_config.json"));
  if (!tok.ok()) return make_error(model_path + ": tokenizer.json: " + tok.error());

  // A model without a chat template still serves completions.
  auto found = chat_template_from_files({model_path, f.tokenizer_file("chat_template.jinja"),
                                         f.tokenizer_file("tokenizer_config.json"), ""});
  if (!found.ok()) return make_error("chat template: " + found.error());
  std::optional<ChatTemplate> tmpl = std::move(found.value());
  if (tmpl) tmpl->set_special_tokens(tok.value()->bos_token(), tok.value()->eos_token());

  std::vector<int32_t> stop_ids = f.desc().eos_token_ids;
  if (int32_t eos = tok.value()->eos_id(); eos >= 0 && std::find(stop_ids.begin(), stop_ids.end(), eos) == stop_ids.end()) {
    stop_ids.push_back(eos);
  }
  if (stop_ids.empty()) return make_error(model_path + ": no EOS token id in config.json, generation_config.json or the tokenizer");
  const int model_vocab = f.desc().vocab_size;
  if (model_vocab > 0 && tok.value()->vocab_size() > model_vocab)
    std::fprintf(stderr, "moe-gateway: warning: the tokenizer has %d token ids, the model has rows for %d; requests "
                 "naming the others are refused, and text that encodes to them fails\n", tok.value()->vocab_size(),
                 model_vocab);
  return std::unique_ptr<TextCodec>(std::make_unique<ModelTextCodec>(std::move(tok.value()), std::move(tmpl),
                                                                     std::move(stop_ids), model_vocab));
}

}  // namespace moe::gw
