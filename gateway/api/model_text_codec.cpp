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
    // What a client wrote is text: "<|im_end|>" in a message, a tool's
    // description or name, or a template variable must not end a turn and
    // open another role's. Only the template writes special tokens. Strings
    // holding a special token's text are marked, and their spans of the
    // rendered prompt encoded as text (docs/gateway.md).
    thread_local std::mt19937_64 rng{std::random_device{}()};
    char hex[33];
    std::snprintf(hex, sizeof hex, "%016llx%016llx", static_cast<unsigned long long>(rng()),
                  static_cast<unsigned long long>(rng()));
    const std::string nonce = hex, open = open_mark(nonce), close = close_mark(nonce);
    nlohmann::json marked_messages, marked_kwargs;
    const bool in_messages = mark_strings(messages, open, close, marked_messages);
    const bool in_kwargs = mark_strings(template_kwargs, open, close, marked_kwargs);
    auto text = tmpl_->render(in_messages ? marked_messages : messages, /*add_generation_prompt=*/true,
                              in_kwargs ? marked_kwargs : template_kwargs);
    if (!text.ok()) return make_error(text.error());
    // The template writes the special tokens (BOS included) itself.
    if (!in_messages && !in_kwargs) return tok_->encode(text.value(), false);
    return encode_marked(text.value(), nonce);
  }

  // Every string a client wrote that holds a special token's text, object
  // keys included, between marks: in a copy of `v` in `out` (true), or
  // nothing (false, `out` untouched).
  bool mark_strings(const nlohmann::json& v, const std::string& open, const std::string& close,
                    nlohmann::json& out) const {
    auto marked = [&](const std::string& s) { return open + s + close; };
    if (v.is_string()) {
      if (!tok_->has_special_text(v.get_ref<const std::string&>())) return false;
      out = marked(v.get<std::string>());
      return true;
    }
    if (v.is_array()) {
      bool any = false;
      nlohmann::json copy = nlohmann::json::array();
      for (const auto& e : v) {
        nlohmann::json m;
        const bool changed = mark_strings(e, open, close, m);
        any = any || changed;
        copy.push_back(changed ? std::move(m) : e);
      }
      if (any) out = std::move(copy);
      return any;
    }
    if (v.is_object()) {
      bool any = false;
      nlohmann::json copy = nlohmann::json::object();
      for (const auto& [key, e] : v.items()) {
        nlohmann::json m;
        const bool changed = mark_strings(e, open, close, m);
        const bool key_special = tok_->has_special_text(key);
        any = any || changed || key_special;
        copy[key_special ? marked(key) : key] = changed ? std::move(m) : e;
      }
      if (any) out = std::move(copy);
      return any;
    }
    return false;
  }

  // A rendered prompt with marked spans: the template's text with its
  // special tokens, each marked span as text.
  Result<std::vector<int32_t>> encode_marked(const std::string& text, const std::string& nonce) const {
    const std::string open = open_mark(nonce), close = close_mark(nonce);
    std::vector<int32_t> ids;
    auto add = [&](size_t from, size_t to, bool specials) {
      const std::vector<int32_t> part =
          tok_->encode_part(std::string_view(text).substr(from, to - from), specials, /*at_text_start=*/from == 0);
      ids.insert(ids.end(), part.begin(), part.end());
    };
    const auto cut = [] {
      return make_error("the chat template cut a message's text apart; it cannot be kept apart from its special tokens");
    };
    size_t at = 0;
    for (;;) {
      const size_t o = text.find(open, at);
      const size_t plain_end = o == std::string::npos ? text.size() : o;
      if (text.find(close, at) < plain_end) return cut();
      add(at, plain_end, /*specials=*/true);
      if (o == std::string::npos) break;
      const size_t start = o + open.size(), c = text.find(close, start);
      if (c == std::string::npos || text.find(open, start) < c) return cut();
      add(start, c, /*specials=*/false);
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
