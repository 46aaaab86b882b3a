#pragma once
// Chat templates: turn a list of chat messages into the model's prompt text,
// the way transformers' apply_chat_template does. A template is Jinja source
// shipped with the model; it is parsed once and rendered per request by the
// interpreter in tokenizer/jinja_*.

#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>

#include "model/result.h"

namespace moe {

namespace jinja {
struct Program;
}

class ChatTemplate {
 public:
  // Parses Jinja source. Errors name the line: "chat template line 3: unknown filter 'foo'".
  static Result<ChatTemplate> parse(std::string source);

  // Renders `messages` (a JSON list of {role, content, …}). The template sees
  // `messages`, `add_generation_prompt`, `tools` and `documents` (none unless
  // given), the special tokens this template was loaded with (bos_token,
  // eos_token), and every key of `extra_context`, which overrides them.
  // A template's raise_exception("…") comes back as an error with exactly
  // that message; other failures name the line. Each call renders with
  // state of its own: one ChatTemplate may render on several threads at once.
  Result<std::string> render(const nlohmann::json& messages, bool add_generation_prompt,
                             const nlohmann::json& extra_context = nlohmann::json::object()) const;
  // The same, keeping the key order of the JSON as written: `tojson` prints
  // dicts in insertion order, so tool schemas print as the client sent them.
  Result<std::string> render_ordered(
      const nlohmann::ordered_json& messages, bool add_generation_prompt,
      const nlohmann::ordered_json& extra_context = nlohmann::ordered_json::object()) const;

  const std::string& source() const { return source_; }

  // Special tokens from tokenizer_config.json (empty when absent).
  const std::string& bos_token() const { return bos_token_; }
  const std::string& eos_token() const { return eos_token_; }
  void set_special_tokens(std::string bos, std::string eos);

 private:
  ChatTemplate() = default;

  std::string source_;
  std::shared_ptr<const jinja::Program> program_;  // shared: copies of a ChatTemplate are cheap
  std::string bos_token_;
  std::string eos_token_;
};

// The texts of a model's files that may hold its chat template; "" where a
// file is absent. `where` prefixes error messages (the folder or file path).
struct ChatTemplateFiles {
  std::string where;
  std::string chat_template_jinja;    // chat_template.jinja
  std::string tokenizer_config_json;  // tokenizer_config.json
  std::string chat_template_json;     // chat_template.json
};

// The chat template those files define: chat_template.jinja, else
// `chat_template` in tokenizer_config.json — a string, or a list of
// {name, template} of which "default" is taken — else chat_template.json;
// plus bos_token / eos_token from tokenizer_config.json (strings or
// {content: …}). nullopt when the model has no chat template; an error when
// one is there but broken.
Result<std::optional<ChatTemplate>> chat_template_from_files(const ChatTemplateFiles& files);

// The same for a model (or tokenizer-only) folder; a folder without a chat
// template is an error.
Result<ChatTemplate> load_chat_template(const std::string& dir);

}  // namespace moe
