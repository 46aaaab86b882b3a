#include "gateway/api/parameter_support.h"

#include <functional>

namespace moe::gw {
namespace {

using json = nlohmann::json;
using Accepts = std::function<bool(const json&)>;

enum class Apis { chat, completions, both };

struct Entry {
  UnsupportedParameter doc;
  Apis apis;
  Accepts accepts;  // the value asks for nothing
};

bool is_number(const json& v, double x) { return v.is_number() && v.get<double>() == x; }
bool is_empty(const json& v) {
  if (v.is_string()) return v.get_ref<const std::string&>().empty();
  return (v.is_array() || v.is_object()) && v.empty();
}
bool is_bool(const json& v, bool b) { return v.is_boolean() && v.get<bool>() == b; }
bool is_one_of(const json& v, std::initializer_list<const char*> values) {
  if (!v.is_string()) return false;
  for (const char* s : values)
    if (v.get<std::string>() == s) return true;
  return false;
}
bool never(const json&) { return false; }

const std::vector<Entry>& table() {
  static const std::vector<Entry> t = {
      // OpenAI, both endpoints
      // OpenAI, completions
      {{"suffix", "completions", "\"\""}, Apis::completions, is_empty},
      // OpenAI, chat (tools and tool_choice are honoured: completion_request.cpp)
      {{"functions", "chat", "[] (use tools)"}, Apis::chat, is_empty},
      {{"function_call", "chat", "\"none\", \"auto\""}, Apis::chat,
       [](const json& v) { return is_one_of(v, {"none", "auto"}); }},
      {{"audio", "chat", "nothing"}, Apis::chat, never},
      {{"modalities", "chat", "[\"text\"]"}, Apis::chat,
       [](const json& v) { return v.is_array() && v.size() == 1 && v[0] == "text"; }},
      {{"web_search_options", "chat", "nothing"}, Apis::chat, never},
      {{"reasoning_effort", "chat", "nothing"}, Apis::chat, never},
      {{"verbosity", "chat", "\"medium\""}, Apis::chat, [](const json& v) { return is_one_of(v, {"medium"}); }},
      {{"store", "chat", "false (nothing is stored)"}, Apis::chat, [](const json& v) { return is_bool(v, false); }},
      // Other servers' sampling and template extensions
      {{"bad_words", "both", "[]"}, Apis::both, is_empty},
      {{"use_beam_search", "both", "false"}, Apis::both, [](const json& v) { return is_bool(v, false); }},
      {{"length_penalty", "both", "1"}, Apis::both, [](const json& v) { return is_number(v, 1); }},
      {{"include_stop_str_in_output", "both", "false"}, Apis::both, [](const json& v) { return is_bool(v, false); }},
      {{"guided_json", "both", "nothing"}, Apis::both, never},
      {{"guided_regex", "both", "nothing"}, Apis::both, never},
      {{"guided_choice", "both", "nothing"}, Apis::both, never},
      {{"guided_grammar", "both", "nothing"}, Apis::both, never},
      {{"structured_outputs", "both", "nothing"}, Apis::both, never},
      {{"grammar", "both", "nothing"}, Apis::both, never},
      {{"json_schema", "both", "nothing"}, Apis::both, never},
      {{"allowed_token_ids", "both", "[]"}, Apis::both, is_empty},
      {{"structural_tag", "both", "nothing"}, Apis::both, never},
      {{"prompt_logprobs", "both", "0"}, Apis::both, [](const json& v) { return is_number(v, 0); }},
      {{"return_tokens_as_token_ids", "both", "false"}, Apis::both, [](const json& v) { return is_bool(v, false); }},
      {{"repeat_penalty", "both", "1"}, Apis::both, [](const json& v) { return is_number(v, 1); }},
      {{"typical_p", "both", "1"}, Apis::both, [](const json& v) { return is_number(v, 1); }},
      {{"mirostat", "both", "0"}, Apis::both, [](const json& v) { return is_number(v, 0); }},
      {{"top_a", "both", "0"}, Apis::both, [](const json& v) { return is_number(v, 0); }},
      {{"n_predict", "both", "nothing (max_tokens)"}, Apis::both, never},
      {{"chat_template", "chat", "nothing (the model's own template is used)"}, Apis::chat, never},
      {{"documents", "chat", "[]"}, Apis::chat, is_empty},
      {{"add_generation_prompt", "chat", "true"}, Apis::chat, [](const json& v) { return is_bool(v, true); }},
      {{"continue_final_message", "chat", "false"}, Apis::chat, [](const json& v) { return is_bool(v, false); }},
      {{"echo", "chat", "false"}, Apis::chat, [](const json& v) { return is_bool(v, false); }},
  };
  return t;
}

std::string describe(const json& v) {
  std::string s = v.dump();
  if (s.size() <= 80) return s;
  size_t cut = 77;
  while (cut > 0 && (static_cast<unsigned char>(s[cut]) & 0xC0) == 0x80) --cut;  // not inside a character
  return s.substr(0, cut) + "...";
}

}  // namespace

std::optional<ApiError> refuse_unsupported(ApiKind kind, const json& body) {
  if (!body.is_object()) return std::nullopt;
  for (const Entry& e : table()) {
    if (e.apis == Apis::chat && kind != ApiKind::chat) continue;
    if (e.apis == Apis::completions && kind != ApiKind::completion) continue;
    auto it = body.find(e.doc.name);
    if (it == body.end() || it->is_null() || e.accepts(*it)) continue;
    return invalid_param(e.doc.name,
                         std::string("'") + e.doc.name + "' is not supported by this server (got " + describe(*it) +
                             "; accepted: " + e.doc.accepted + ").",
                         "unsupported_parameter");
  }
  // An assistant turn's (deprecated) function_call or audio cannot be
  // rendered; tool_calls can (completion_request.cpp).
  if (kind == ApiKind::chat) {
    auto msgs = body.find("messages");
    if (msgs != body.end() && msgs->is_array()) {
      for (size_t i = 0; i < msgs->size(); ++i) {
        const json& m = (*msgs)[i];
        if (!m.is_object()) continue;
        for (const char* key : {"function_call", "audio"}) {
          auto f = m.find(key);
          if (f != m.end() && !f->is_null() && !is_empty(*f)) {
            const std::string param = "messages[" + std::to_string(i) + "]." + key;
            return invalid_param(param, "'" + param + "' is not supported by this server.", "unsupported_parameter");
          }
        }
      }
    }
  }
  return std::nullopt;
}

const std::vector<UnsupportedParameter>& unsupported_parameters() {
  static const std::vector<UnsupportedParameter> docs = [] {
    std::vector<UnsupportedParameter> d;
    for (const Entry& e : table()) d.push_back(e.doc);
    return d;
  }();
  return docs;
}

}  // namespace moe::gw
