#include "tokenizer/chat_template.h"

#include <fstream>
#include <new>
#include <sstream>
#include <utility>

#include "tokenizer/jinja_builtins.h"
#include "tokenizer/jinja_interpreter.h"
#include "tokenizer/jinja_parser.h"

namespace moe {

namespace {

Error template_error(const jinja::TemplateError& e) {
  if (e.raised) return make_error(e.what());
  if (e.line > 0)
    return make_error("chat template line " + std::to_string(e.line) + ": " + e.what());
  return make_error(std::string("chat template: ") + e.what());
}

// The boundary of the interpreter: its failures unwind by exception to here
// and leave as values.
template <typename F>
auto guarded(F&& f) -> Result<decltype(f())> {
  try {
    return f();
  } catch (const jinja::TemplateError& e) {
    return template_error(e);
  } catch (const std::bad_alloc&) {
    return make_error("chat template: out of memory");
  } catch (const std::exception& e) {
    return make_error(std::string("chat template: ") + e.what());
  }
}

template <typename Json>
Result<std::string> render_json(const jinja::Program& program, const std::string& bos,
                                const std::string& eos, const Json& messages,
                                bool add_generation_prompt, const Json& extra_context) {
  if (!messages.is_array()) return make_error("chat template: messages must be a JSON list");
  if (!extra_context.is_null() && !extra_context.is_object())
    return make_error("chat template: extra context must be a JSON object");
  return guarded([&] {
    jinja::Interpreter in(program);
    if (!bos.empty()) in.set_global("bos_token", jinja::Value(bos));
    if (!eos.empty()) in.set_global("eos_token", jinja::Value(eos));
    // transformers always passes these two, as none when the request has none.
    in.set_global("tools", jinja::Value(jinja::None{}));
    in.set_global("documents", jinja::Value(jinja::None{}));
    if (extra_context.is_object())
      for (auto it = extra_context.begin(); it != extra_context.end(); ++it)
        in.set_global(it.key(), jinja::from_json(it.value()));
    in.set_global("messages", jinja::from_json(messages));
    in.set_global("add_generation_prompt", jinja::Value(add_generation_prompt));
    return in.render();
  });
}

Result<std::string> read_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) return make_error("cannot open " + path);
  std::ostringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

bool file_exists(const std::string& path) { return std::ifstream(path).good(); }

// A special token in tokenizer_config.json: "<s>" or {"content": "<s>", …}.
std::string token_text(const nlohmann::json& config, const char* key) {
  auto it = config.find(key);
  if (it == config.end()) return "";
  if (it->is_string()) return it->get<std::string>();
  if (it->is_object() && it->contains("content") && (*it)["content"].is_string())
    return (*it)["content"].get<std::string>();
  return "";
}

// `chat_template` as a string, or a list of {name, template}: "default" wins.
Result<std::string> template_from_config(const nlohmann::json& value, const std::string& where) {
  if (value.is_string()) return value.get<std::string>();
  if (value.is_array()) {
    for (const auto& entry : value)
      if (entry.is_object() && entry.value("name", "") == "default" && entry.contains("template") &&
          entry["template"].is_string())
        return entry["template"].get<std::string>();
    return make_error(where + ": chat_template is a list without a \"default\" entry");
  }
  return make_error(where + ": chat_template must be a string or a list of {name, template}");
}

}  // namespace

Result<ChatTemplate> ChatTemplate::parse(std::string source) {
  auto program = guarded([&] {
    auto p = std::make_shared<jinja::Program>(jinja::parse_template(source));
    jinja::check_names(*p);
    return std::shared_ptr<const jinja::Program>(std::move(p));
  });
  if (!program) return make_error(program.error());
  ChatTemplate t;
  t.source_ = std::move(source);
  t.program_ = std::move(*program);
  return t;
}

void ChatTemplate::set_special_tokens(std::string bos, std::string eos) {
  bos_token_ = std::move(bos);
  eos_token_ = std::move(eos);
}

Result<std::string> ChatTemplate::render(const nlohmann::json& messages, bool add_generation_prompt,
                                         const nlohmann::json& extra_context) const {
  return render_json(*program_, bos_token_, eos_token_, messages, add_generation_prompt,
                     extra_context);
}

Result<std::string> ChatTemplate::render_ordered(
    const nlohmann::ordered_json& messages, bool add_generation_prompt,
    const nlohmann::ordered_json& extra_context) const {
  return render_json(*program_, bos_token_, eos_token_, messages, add_generation_prompt,
                     extra_context);
}

Result<std::optional<ChatTemplate>> chat_template_from_files(const ChatTemplateFiles& files) {
  const std::string config_name = files.where + "/tokenizer_config.json";
  nlohmann::json config = nlohmann::json::object();
  if (!files.tokenizer_config_json.empty()) {
    config = nlohmann::json::parse(files.tokenizer_config_json, nullptr, /*allow_exceptions=*/false);
    if (config.is_discarded() || !config.is_object())
      return make_error(config_name + ": not a JSON object");
  }

  std::string source;
  if (!files.chat_template_jinja.empty()) {
    source = files.chat_template_jinja;
  } else if (config.contains("chat_template")) {
    auto t = template_from_config(config["chat_template"], config_name);
    if (!t) return make_error(t.error());
    source = std::move(*t);
  } else if (!files.chat_template_json.empty()) {
    const std::string json_name = files.where + "/chat_template.json";
    auto j = nlohmann::json::parse(files.chat_template_json, nullptr, false);
    if (j.is_discarded() || !j.is_object() || !j.contains("chat_template"))
      return make_error(json_name + ": no chat_template in it");
    auto t = template_from_config(j["chat_template"], json_name);
    if (!t) return make_error(t.error());
    source = std::move(*t);
  } else {
    return std::optional<ChatTemplate>();
  }

  auto parsed = ChatTemplate::parse(std::move(source));
  if (!parsed) return make_error(files.where + ": " + parsed.error());
  parsed->set_special_tokens(token_text(config, "bos_token"), token_text(config, "eos_token"));
  return std::optional<ChatTemplate>(std::move(*parsed));
}

Result<ChatTemplate> load_chat_template(const std::string& dir) {
  ChatTemplateFiles files;
  files.where = dir;
  const std::pair<const char*, std::string*> wanted[] = {
      {"/chat_template.jinja", &files.chat_template_jinja},
      {"/tokenizer_config.json", &files.tokenizer_config_json},
      {"/chat_template.json", &files.chat_template_json},
  };
  for (const auto& [name, text] : wanted) {
    const std::string path = dir + name;
    if (!file_exists(path)) continue;
    auto read = read_file(path);
    if (!read) return make_error(read.error());
    *text = std::move(*read);
  }
  auto t = chat_template_from_files(files);
  if (!t) return make_error(t.error());
  if (!t->has_value())
    return make_error("no chat template in " + dir +
                      " (neither chat_template.jinja nor chat_template in tokenizer_config.json)");
  return std::move(**t);
}

}  // namespace moe
