#pragma once
// What the OpenAI layer needs of the model's text side: prompts to token ids
// (plain text, or chat messages through the model's chat template) and
// generated ids back to text, incrementally. The gateway's implementation is
// ModelTextCodec (the model's tokenizer.json and chat template); tests may
// give their own.

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "model/result.h"

namespace moe::gw {

// Detokenises one generated sequence: push() returns only complete UTF-8
// text; flush() returns what is left at the end.
class TokenTextStream {
 public:
  virtual ~TokenTextStream() = default;
  virtual std::string push(int32_t id) = 0;
  virtual std::string flush() = 0;
};

class TextCodec {
 public:
  virtual ~TextCodec() = default;
  // A /v1/completions prompt (with the tokenizer's own special tokens, e.g. BOS).
  virtual std::vector<int32_t> encode(std::string_view text) const = 0;
  // Chat messages ([{role, content: string}, …]) rendered through the chat
  // template with the generation prompt, then encoded. Fails when the
  // template rejects the conversation (e.g. roles out of order).
  virtual Result<std::vector<int32_t>> encode_chat(const nlohmann::json& messages) const = 0;
  // The same with more variables for the template (`chat_template_kwargs`,
  // e.g. enable_thinking); a codec whose template takes none refuses any.
  virtual Result<std::vector<int32_t>> encode_chat(const nlohmann::json& messages,
                                                   const nlohmann::json& template_kwargs) const {
    if (template_kwargs.is_object() && !template_kwargs.empty())
      return make_error("this model's chat template takes no chat_template_kwargs");
    return encode_chat(messages);
  }
  // A thinking model's tags around its reasoning (e.g. "<think>", "</think>"),
  // which the chat API returns as `reasoning_content`; empty strings when the
  // model has none.
  struct ReasoningTags {
    std::string open, close;
  };
  virtual ReasoningTags reasoning_tags() const { return {}; }
  // How the model's chat template asks for tool calls: Hermes-style
  // <tool_call>{json}</tool_call> (Qwen's), Mistral's [TOOL_CALLS] [{json}, …],
  // or none (its template takes no tools).
  enum class ToolFormat { none, hermes, mistral };
  virtual ToolFormat tool_format() const { return ToolFormat::none; }
  virtual std::unique_ptr<TokenTextStream> stream_decoder() const = 0;
  // The bytes one token stands for (may be part of a UTF-8 character); for logprobs.
  virtual std::string token_bytes(int32_t id) const = 0;
  // The same with a part of a character left as its own bytes (token_bytes
  // may give U+FFFD there): what logprobs' "bytes" report, so that a
  // client joining them gets the character back.
  virtual std::string token_raw_bytes(int32_t id) const { return token_bytes(id); }
  // A control token (chat markers, BOS/EOS…): never text a grammar allows.
  virtual bool is_special(int32_t id) const {
    (void)id;
    return false;
  }
  // Ids are valid in [0, vocab_size()).
  virtual int vocab_size() const = 0;
  // Ids whose generation ends a sequence (EOS, end of turn); never shown as text.
  virtual std::vector<int32_t> stop_token_ids() const = 0;
};

}  // namespace moe::gw
