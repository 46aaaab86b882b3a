#include "gateway/api/completion_request.h"

#include <algorithm>
#include <cctype>
#include <limits>
#include <set>

#include "gateway/api/parameter_support.h"
#include "gateway/json_body.h"

namespace moe::gw {
namespace {

using json = nlohmann::json;

// A present, non-null member, or nullptr.
const json* member(const json& obj, const char* key) {
  auto it = obj.find(key);
  if (it == obj.end() || it->is_null()) return nullptr;
  return &*it;
}

std::optional<ApiError> wrong_type(const char* param, const char* what) {
  return invalid_param(param, std::string("'") + param + "' must be " + what + ".", "invalid_type");
}

std::optional<ApiError> read_int(const json& body, const char* key, std::optional<int64_t>* out) {
  const json* v = member(body, key);
  if (!v) return std::nullopt;
  if (!v->is_number_integer()) return wrong_type(key, "an integer");
  if (v->is_number_unsigned() && v->get<uint64_t>() > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
    *out = std::numeric_limits<int64_t>::max();
  } else {
    *out = v->get<int64_t>();
  }
  return std::nullopt;
}

// A seed names one stream of draws: one past int64 is refused, not clamped
// (every such seed would have drawn the same tokens).
std::optional<ApiError> read_seed(const json& body, std::optional<int64_t>* out) {
  const json* v = member(body, "seed");
  if (v && v->is_number_unsigned() && v->get<uint64_t>() > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()))
    return invalid_param("seed", "'seed' must be an integer from -9223372036854775808 to 9223372036854775807.",
                         "invalid_value");
  return read_int(body, "seed", out);
}

std::optional<ApiError> read_number(const json& body, const char* key, std::optional<double>* out) {
  const json* v = member(body, key);
  if (!v) return std::nullopt;
  if (!v->is_number()) return wrong_type(key, "a number");
  *out = v->get<double>();
  return std::nullopt;
}

std::optional<ApiError> read_bool(const json& body, const char* key, std::optional<bool>* out) {
  const json* v = member(body, key);
  if (!v) return std::nullopt;
  if (!v->is_boolean()) return wrong_type(key, "a boolean");
  *out = v->get<bool>();
  return std::nullopt;
}

// The text of one chat message's content: a string, or an array of
// {"type": "text", "text": …} parts joined together.
std::optional<ApiError> message_text(const json& content, size_t index, std::string* out) {
  std::string param = "messages[" + std::to_string(index) + "].content";
  if (content.is_null()) return std::nullopt;
  if (content.is_string()) {
    *out = content.get<std::string>();
    return std::nullopt;
  }
  if (!content.is_array()) return invalid_param(param, "'" + param + "' must be a string or an array of parts.", "invalid_type");
  for (const json& part : content) {
    const json* type = part.is_object() ? member(part, "type") : nullptr;
    if (!type || !type->is_string()) {
      return invalid_param(param, "each part of '" + param + "' must be an object with a 'type'.", "invalid_type");
    }
    if (*type != "text") {
      return invalid_param(param, "content parts of type '" + type->get<std::string>() + "' are not supported; only 'text'.",
                           "unsupported_value");
    }
    const json* text = member(part, "text");
    if (!text || !text->is_string()) return invalid_param(param, "a text part of '" + param + "' must have a string 'text'.", "invalid_type");
    *out += text->get<std::string>();
  }
  return std::nullopt;
}

// An assistant turn's tool_calls: [{id, type "function", function {name,
// arguments}}], at most 64; `arguments` a string (as OpenAI sends it) or an
// object. *out: the list as compact JSON, arguments always strings.
std::optional<ApiError> validated_tool_calls(const json& calls, const std::string& where, std::string* out) {
  if (!calls.is_array()) return invalid_param(where, "'" + where + "' must be an array.", "invalid_type");
  if (calls.size() > 64) return invalid_param(where, "'" + where + "' may hold at most 64 calls.", "invalid_value");
  json list = json::array();
  for (size_t k = 0; k < calls.size(); ++k) {
    const json& c = calls[k];
    const std::string at = where + "[" + std::to_string(k) + "]";
    const json* fn = c.is_object() ? member(c, "function") : nullptr;
    const json* name = fn && fn->is_object() ? member(*fn, "name") : nullptr;
    if (!name || !name->is_string())
      return invalid_param(at, "'" + at + "' must be {\"id\", \"type\": \"function\", \"function\": {\"name\", \"arguments\"}}.",
                           "invalid_type");
    const json* type = member(c, "type");
    if (type && !(type->is_string() && type->get<std::string>() == "function"))
      return invalid_param(at + ".type", "'" + at + ".type' must be 'function'.", "invalid_value");
    const json* id = member(c, "id");
    if (id && !id->is_string()) return invalid_param(at + ".id", "'" + at + ".id' must be a string.", "invalid_type");
    const json* args = member(*fn, "arguments");
    std::string arguments = "{}";
    if (args && args->is_string()) arguments = args->get<std::string>();
    else if (args && args->is_object()) arguments = args->dump();
    else if (args && !args->is_null())
      return invalid_param(at + ".function.arguments", "'" + at + ".function.arguments' must be a string.", "invalid_type");
    list.push_back({{"id", id ? id->get<std::string>() : ""},
                    {"type", "function"},
                    {"function", {{"name", name->get<std::string>()}, {"arguments", arguments}}}});
  }
  *out = list.dump();
  return std::nullopt;
}

// The grammar of tool_choice "required" (any of the tools) or one named
// function: <tool_call>\n{"name": …, "arguments": {…}}\n</tool_call>; under
// "required" again after a newline when parallel calls are allowed (a named
// function: once). A tool's arguments
// follow its parameters' schema when that compiles on its own (no $ref),
// else any object; more than 8 tools: a name among them and any object.
Result<std::shared_ptr<const structured::Schema>> tool_call_schema(const CompletionRequest& req,
                                                                    TextCodec::ToolFormat format) {
  json options = json::array();
  json names = json::array();
  for (const json& t : req.tools) {
    const json& fn = t["function"];
    const std::string name = fn["name"].get<std::string>();
    if (req.tool_choice == CompletionRequest::ToolChoice::named && name != req.tool_name) continue;
    names.push_back(name);
    // No parameters: an empty parameter list, so the arguments are {}.
    json params = fn.contains("parameters")
                      ? fn["parameters"]
                      : json{{"type", "object"}, {"properties", json::object()}, {"additionalProperties", false}};
    if (params.dump().find("\"$ref\"") != std::string::npos || !structured::compile_json_schema(params).ok())
      params = json{{"type", "object"}};
    options.push_back({{"type", "object"},
                       {"properties", {{"name", {{"const", name}}}, {"arguments", params}}},
                       {"required", {"name", "arguments"}},
                       {"additionalProperties", false}});
  }
  json call;
  if (options.size() == 1) {
    call = options[0];
  } else if (options.size() <= size_t(structured::kMaxAlternatives)) {
    call = {{"anyOf", options}};
  } else {
    // The names as one enum, or (past an enum's 64 values) an anyOf of enums.
    json name = {{"enum", names}};
    if (names.size() > size_t(structured::kMaxLiterals)) {
      name = {{"anyOf", json::array()}};
      for (size_t i = 0; i < names.size(); i += size_t(structured::kMaxLiterals))
        name["anyOf"].push_back(
            {{"enum", json(std::vector<json>(names.begin() + long(i),
                                             names.begin() + long(std::min(names.size(), i + size_t(structured::kMaxLiterals)))))}});
    }
    call = {{"type", "object"},
            {"properties", {{"name", name}, {"arguments", {{"type", "object"}}}}},
            {"required", {"name", "arguments"}},
            {"additionalProperties", false}};
  }
  // A named function is called once; "required" may call several when parallel calls are allowed.
  const bool repeat = req.parallel_tool_calls && req.tool_choice == CompletionRequest::ToolChoice::required;
  if (format == TextCodec::ToolFormat::mistral) {
    // [TOOL_CALLS] [{…}, …]: the calls as one JSON list.
    json list = {{"type", "array"}, {"items", call}, {"minItems", 1}};
    if (!repeat) list["maxItems"] = 1;
    auto compiled = structured::compile_json_schema(list);
    if (!compiled.ok()) return make_error(compiled.error());
    return structured::tool_call_sequence(**compiled, "[TOOL_CALLS]", "", "");
  }
  auto compiled = structured::compile_json_schema(call);
  if (!compiled.ok()) return make_error(compiled.error());
  return structured::tool_call_sequence(**compiled, "<tool_call>\n", "\n</tool_call>", repeat ? "\n" : "");
}

std::optional<ApiError> parse_tools(const json& body, const TextCodec& codec, CompletionRequest* req) {
  const json* tools = member(body, "tools");
  if (tools && !tools->is_null()) {
    if (!tools->is_array()) return wrong_type("tools", "an array of tools");
    if (tools->size() > 128) return invalid_param("tools", "'tools' may hold at most 128 tools.", "invalid_value");
    std::set<std::string> seen;
    for (size_t i = 0; i < tools->size(); ++i) {
      const json& t = (*tools)[i];
      const std::string at = "tools[" + std::to_string(i) + "]";
      const json* type = t.is_object() ? member(t, "type") : nullptr;
      const json* fn = t.is_object() ? member(t, "function") : nullptr;
      if (!type || !type->is_string() || type->get<std::string>() != "function" || !fn || !fn->is_object())
        return invalid_param(at, "'" + at + "' must be {\"type\": \"function\", \"function\": {\"name\", …}}.",
                             "invalid_type");
      const json* name = member(*fn, "name");
      if (!name || !name->is_string() || name->get<std::string>().empty() || name->get<std::string>().size() > 64 ||
          !std::all_of(name->get_ref<const std::string&>().begin(), name->get_ref<const std::string&>().end(),
                       [](char ch) { return std::isalnum(static_cast<unsigned char>(ch)) || ch == '_' || ch == '-'; }))
        return invalid_param(at + ".function.name", "'" + at + ".function.name' must be 1 to 64 of a-z, A-Z, 0-9, _ and -.",
                             "invalid_value");
      if (!seen.insert(name->get<std::string>()).second)
        return invalid_param(at + ".function.name", "Two tools are named '" + name->get<std::string>() + "'.",
                             "invalid_value");
      if (const json* d = member(*fn, "description"); d && !d->is_string())
        return invalid_param(at + ".function.description", "'" + at + ".function.description' must be a string.",
                             "invalid_type");
      if (const json* p = member(*fn, "parameters"); p && !p->is_object())
        return invalid_param(at + ".function.parameters", "'" + at + ".function.parameters' must be a JSON schema object.",
                             "invalid_type");
      // A call's arguments are a JSON object: a schema of another type
      // could only give arguments no client can read.
      if (const json* p = member(*fn, "parameters"); p && p->contains("type") && (*p)["type"] != "object")
        return invalid_param(at + ".function.parameters",
                             "'" + at + ".function.parameters' must describe an object (\"type\": \"object\"): a "
                             "call's arguments are a JSON object.",
                             "invalid_value");
    }
    req->tools = *tools;
  }
  const bool have = !req->tools.empty();
  if (have && codec.tool_format() == TextCodec::ToolFormat::none)
    return invalid_param("tools", "This model's chat template does not describe tools to the model, so 'tools' cannot "
                                  "be honoured.", "unsupported_parameter");
  req->tool_choice = have ? CompletionRequest::ToolChoice::automatic : CompletionRequest::ToolChoice::none;
  if (const json* ch = member(body, "tool_choice"); ch && !ch->is_null()) {
    if (ch->is_string()) {
      const std::string v = ch->get<std::string>();
      if (v == "none") req->tool_choice = CompletionRequest::ToolChoice::none;
      else if (v == "auto") req->tool_choice = CompletionRequest::ToolChoice::automatic;
      else if (v == "required") req->tool_choice = CompletionRequest::ToolChoice::required;
      else return invalid_param("tool_choice", "'tool_choice' must be 'none', 'auto', 'required' or a named function.",
                                "invalid_value");
    } else if (ch->is_object() && ch->contains("function") && (*ch)["function"].is_object() &&
               (*ch)["function"].contains("name") && (*ch)["function"]["name"].is_string()) {
      req->tool_choice = CompletionRequest::ToolChoice::named;
      req->tool_name = (*ch)["function"]["name"].get<std::string>();
      bool found = false;
      for (const json& t : req->tools) found = found || t["function"]["name"] == req->tool_name;
      if (!found)
        return invalid_param("tool_choice", "'tool_choice' names '" + req->tool_name + "', which is not among 'tools'.",
                             "invalid_value");
    } else {
      return wrong_type("tool_choice", "'none', 'auto', 'required' or {\"type\": \"function\", \"function\": {\"name\"}}");
    }
    if (!have && req->tool_choice != CompletionRequest::ToolChoice::none)
      return invalid_param("tool_choice", "'tool_choice' other than 'none' needs 'tools'.", "invalid_value");
  }
  std::optional<bool> parallel;
  if (auto e = read_bool(body, "parallel_tool_calls", &parallel)) return e;
  req->parallel_tool_calls = parallel.value_or(true);
  if (req->tool_choice == CompletionRequest::ToolChoice::required ||
      req->tool_choice == CompletionRequest::ToolChoice::named) {
    if (req->response_schema)
      return invalid_param("tool_choice", "'tool_choice' that forces a call cannot be combined with 'response_format'.",
                           "invalid_value");
    auto g = tool_call_schema(*req, codec.tool_format());
    if (!g.ok()) return invalid_param("tools", "'tools': " + g.error() + ".", "invalid_value");
    req->response_schema = *g;
  }
  return std::nullopt;
}

// The chat's prompt. `fit` > 0: the prompt may hold at most this many
// tokens, and a conversation longer than that loses its oldest turns (never
// a system turn nor the last message) until it fits: *dropped says how many.
std::optional<ApiError> chat_prompt(const json& body, const TextCodec& codec, const ChatMessages& prior,
                                    ChatMessages* messages, std::vector<std::vector<int32_t>>* out, int64_t fit,
                                    int* dropped, int64_t* dropped_tokens, const json& tools) {
  if (auto err = parse_chat_messages(body, messages)) return err;
  // A template that knows no tools would drop an assistant turn's calls.
  if (codec.tool_format() == TextCodec::ToolFormat::none)
    for (size_t i = 0; i < messages->size(); ++i)
      if (!(*messages)[i].tool_calls.empty()) {
        const std::string p = "messages[" + std::to_string(i) + "].tool_calls";
        return invalid_param(p, "This model's chat template does not render tool calls ('" + p + "').",
                             "unsupported_parameter");
      }
  json kwargs;
  if (auto err = parse_template_kwargs(body, &kwargs)) return err;
  if (!tools.empty()) kwargs["tools"] = tools;
  // The template sees only validated roles and texts: the session's stored
  // turns first, then this request's.
  ChatMessages all = prior;
  all.insert(all.end(), messages->begin(), messages->end());
  auto render = [&](size_t drop) {
    ChatMessages kept;
    size_t skipped = 0;
    for (size_t i = 0; i < all.size(); ++i) {
      if (skipped < drop && i + 1 < all.size() && all[i].role != "system") {
        ++skipped;
        continue;
      }
      kept.push_back(all[i]);
    }
    return codec.encode_chat(template_messages({}, kept), kwargs);
  };
  auto ids = render(0);
  if (!ids.ok()) return invalid_param("messages", "The chat template rejected the messages: " + ids.error());
  const int64_t full_tokens = static_cast<int64_t>(ids.value().size());
  *dropped = 0;
  *dropped_tokens = 0;
  if (fit > 0 && static_cast<int64_t>(ids.value().size()) > fit) {
    // The cut points: dropping d turns leaves the (d+1)-th non-system
    // message first, which must be a user turn (templates that need roles
    // to alternate refuse the rest), or d drops every droppable turn.
    std::vector<size_t> cuts;
    size_t droppable = 0;
    for (size_t i = 0; i + 1 < all.size(); ++i) droppable += all[i].role != "system";
    {
      size_t k = 0;  // non-system messages seen, the last message included
      for (size_t i = 0; i < all.size(); ++i) {
        if (all[i].role == "system" && i + 1 < all.size()) continue;
        if (k >= 1 && k < droppable && all[i].role == "user") cuts.push_back(k);
        ++k;
      }
      if (droppable > 0) cuts.push_back(droppable);
    }
    auto fits = [&](const Result<std::vector<int32_t>>& r) {
      return r.ok() && static_cast<int64_t>(r.value().size()) <= fit;
    };
    // The fewest turns that fit, by halving (the prompt shortens as the cut
    // moves on; a cut the template refuses counts as not fitting).
    size_t lo = 0, hi = cuts.size();
    std::optional<Result<std::vector<int32_t>>> at_hi;  // render(cuts[hi]) once hi < cuts.size()
    while (lo < hi) {
      const size_t mid = (lo + hi) / 2;
      auto r = render(cuts[mid]);
      if (fits(r)) {
        hi = mid;
        at_hi.emplace(std::move(r));
      } else {
        lo = mid + 1;
      }
    }
    std::optional<size_t> chosen;
    if (hi < cuts.size()) {
      chosen = hi;
      ids = std::move(*at_hi);
    } else if (!cuts.empty()) {
      // Nothing leaves the room asked for: the most trimmed the template
      // takes still goes on (the context check after says whether it can run).
      auto r = render(cuts.back());
      if (r.ok() && r.value().size() < ids.value().size()) {
        chosen = cuts.size() - 1;
        ids = std::move(r);
      }
    }
    if (chosen) {
      *dropped = static_cast<int>(cuts[*chosen]);
      *dropped_tokens = full_tokens - static_cast<int64_t>(ids.value().size());
    }
  }
  out->push_back(std::move(ids.value()));
  return std::nullopt;
}

std::optional<ApiError> completion_prompts(const json& body, const TextCodec& codec,
                                           std::vector<std::vector<int32_t>>* out) {
  const json* p = member(body, "prompt");
  if (!p) return invalid_param("prompt", "Missing required parameter: 'prompt'.", "missing_required_parameter");
  const char* kinds = "a string, an array of strings, an array of token ids or an array of token-id arrays";
  auto token_ids = [&](const json& arr, std::vector<int32_t>* ids) -> std::optional<ApiError> {
    for (const json& t : arr) {
      if (!t.is_number_integer()) return wrong_type("prompt", kinds);
      int64_t id = t.get<int64_t>();
      if (id < 0 || id >= codec.vocab_size()) {
        return invalid_param("prompt", "Token id " + std::to_string(id) + " in 'prompt' is outside the vocabulary [0, " +
                                           std::to_string(codec.vocab_size()) + ").",
                             "invalid_value");
      }
      ids->push_back(static_cast<int32_t>(id));
    }
    return std::nullopt;
  };
  if (p->is_string()) {
    out->push_back(codec.encode(p->get<std::string>()));
  } else if (p->is_array()) {
    if (p->empty()) return invalid_param("prompt", "'prompt' must not be empty.", "empty_array");
    const json& first = p->front();
    if (first.is_number_integer()) {
      std::vector<int32_t> ids;
      if (auto err = token_ids(*p, &ids)) return err;
      out->push_back(std::move(ids));
    } else {
      for (const json& item : *p) {
        if (item.is_string()) {
          out->push_back(codec.encode(item.get<std::string>()));
        } else if (item.is_array() && first.is_array()) {
          std::vector<int32_t> ids;
          if (auto err = token_ids(item, &ids)) return err;
          out->push_back(std::move(ids));
        } else {
          return wrong_type("prompt", kinds);
        }
        if (!first.is_string() && item.is_string()) return wrong_type("prompt", kinds);
      }
    }
  } else {
    return wrong_type("prompt", kinds);
  }
  return std::nullopt;
}

}  // namespace

std::optional<ApiError> parse_chat_messages(const json& body, ChatMessages* messages) {
  const json* msgs = member(body, "messages");
  if (!msgs) return invalid_param("messages", "Missing required parameter: 'messages'.", "missing_required_parameter");
  if (!msgs->is_array()) return wrong_type("messages", "an array");
  if (msgs->empty()) return invalid_param("messages", "'messages' must contain at least one message.", "empty_array");
  for (size_t i = 0; i < msgs->size(); ++i) {
    const json& m = (*msgs)[i];
    std::string where = "messages[" + std::to_string(i) + "]";
    if (!m.is_object()) return invalid_param(where, "'" + where + "' must be an object.", "invalid_type");
    const json* role = member(m, "role");
    if (!role) return invalid_param(where + ".role", "Missing required parameter: '" + where + ".role'.", "missing_required_parameter");
    if (!role->is_string()) return invalid_param(where + ".role", "'" + where + ".role' must be a string.", "invalid_type");
    std::string r = role->get<std::string>();
    if (r != "system" && r != "user" && r != "assistant" && r != "tool" && r != "developer") {
      return invalid_param(where + ".role", "Invalid value for '" + where + ".role': '" + r +
                                                "'. Supported values are: 'system', 'developer', 'user', 'assistant' and 'tool'.",
                           "invalid_value");
    }
    auto it = m.find("content");
    if (it == m.end() && r != "assistant") {
      return invalid_param(where + ".content", "Missing required parameter: '" + where + ".content'.", "missing_required_parameter");
    }
    // null only where a turn may say nothing but its calls (OpenAI's rule).
    if (it != m.end() && it->is_null() && r != "assistant")
      return invalid_param(where + ".content", "'" + where + ".content' must be a string or an array of parts; only an "
                                               "assistant's may be null.", "invalid_type");
    std::string text;
    if (it != m.end()) {
      if (auto err = message_text(*it, i, &text)) return err;
    }
    // Templates written for OpenAI-style roles know "system"; "developer" is its newer name.
    ChatMessage msg{r == "developer" ? "system" : r, std::move(text), "", ""};
    if (const json* calls = member(m, "tool_calls"); calls && !calls->is_null()) {
      if (r != "assistant")
        return invalid_param(where + ".tool_calls", "Only assistant messages carry 'tool_calls'.", "invalid_value");
      std::string normal;
      if (auto err = validated_tool_calls(*calls, where + ".tool_calls", &normal)) return err;
      msg.tool_calls = std::move(normal);
    }
    if (const json* id = member(m, "tool_call_id"); id && !id->is_null()) {
      if (!id->is_string())
        return invalid_param(where + ".tool_call_id", "'" + where + ".tool_call_id' must be a string.", "invalid_type");
      if (r == "tool") msg.tool_call_id = id->get<std::string>();
    }
    messages->push_back(std::move(msg));
  }
  return std::nullopt;
}

std::optional<ApiError> parse_template_kwargs(const json& body, json* out) {
  *out = json::object();
  const json* kw = member(body, "chat_template_kwargs");
  if (!kw) return std::nullopt;
  if (!kw->is_object()) return wrong_type("chat_template_kwargs", "an object");
  for (const char* reserved : {"messages", "add_generation_prompt", "tools", "documents", "bos_token", "eos_token"})
    if (kw->contains(reserved))
      return invalid_param("chat_template_kwargs", std::string("'chat_template_kwargs' may not set '") + reserved + "'.",
                           "invalid_value");
  *out = *kw;
  return std::nullopt;
}

json template_messages(const ChatMessages& prior, const ChatMessages& messages) {
  json rendered = json::array();
  for (const ChatMessages* list : {&prior, &messages})
    for (const ChatMessage& m : *list) {
      json t = {{"role", m.role}, {"content", m.content}};
      if (!m.tool_calls.empty()) {
        // What templates read: the calls with their arguments as a string
        // (OpenAI's shape; Qwen's template writes a string as it is).
        json calls = json::parse(m.tool_calls, nullptr, false);
        if (calls.is_array()) t["tool_calls"] = calls;
      }
      if (!m.tool_call_id.empty()) t["tool_call_id"] = m.tool_call_id;
      rendered.push_back(std::move(t));
    }
  return rendered;
}

ParsedRequest parse_completion_request(ApiKind kind, std::string_view body_text, const TextCodec& codec,
                                       const RequestLimits& limits, const ChatMessages& prior) {
  ParsedJson body = parse_json_body(body_text);
  if (auto* err = std::get_if<ApiError>(&body)) return *err;
  return parse_completion_request(kind, std::get<json>(body), codec, limits, prior);
}

ParsedRequest parse_completion_request(ApiKind kind, const json& body, const TextCodec& codec,
                                       const RequestLimits& limits, const ChatMessages& prior) {
  if (!body.is_object()) {
    return ApiError{400, "The request body must be a JSON object.", "invalid_request_error", "", "invalid_json"};
  }

  CompletionRequest req;
  req.kind = kind;

  const json* model = member(body, "model");
  if (!model) return invalid_param("model", "Missing required parameter: 'model'.", "missing_required_parameter");
  if (!model->is_string()) return *wrong_type("model", "a string");
  req.model = model->get<std::string>();
  // A parameter we do not honour, given a value that asks for something.
  if (auto refused = refuse_unsupported(kind, body)) return *refused;

  // Sampling and output parameters: types first, then ranges.
  std::optional<int64_t> max_tokens, max_completion_tokens, top_k, n, seed, top_logprobs, completion_logprobs;
  std::optional<double> temperature, top_p;
  std::optional<bool> stream, chat_logprobs, echo;
  std::optional<ApiError> err;
  if ((err = read_int(body, "max_tokens", &max_tokens)) || (err = read_int(body, "top_k", &top_k)) ||
      (err = read_int(body, "n", &n)) || (err = read_seed(body, &seed)) ||
      (err = read_number(body, "temperature", &temperature)) || (err = read_number(body, "top_p", &top_p)) ||
      (err = read_bool(body, "stream", &stream))) {
    return *err;
  }
  if (kind == ApiKind::chat) {
    if ((err = read_int(body, "max_completion_tokens", &max_completion_tokens)) ||
        (err = read_bool(body, "logprobs", &chat_logprobs)) || (err = read_int(body, "top_logprobs", &top_logprobs))) {
      return *err;
    }
  } else {
    if ((err = read_int(body, "logprobs", &completion_logprobs)) || (err = read_bool(body, "echo", &echo))) return *err;
  }

  if (max_completion_tokens) max_tokens = max_completion_tokens;
  const char* max_param = max_completion_tokens ? "max_completion_tokens" : "max_tokens";
  if (max_tokens && *max_tokens <= 0) {
    return invalid_param(max_param, std::string("'") + max_param + "' must be at least 1, got " +
                                        std::to_string(*max_tokens) + ".", "invalid_value");
  }
  if (temperature && (*temperature < 0.0 || *temperature > 2.0)) {
    return invalid_param("temperature", "'temperature' must be between 0 and 2.", "invalid_value");
  }
  if (top_p && (*top_p <= 0.0 || *top_p > 1.0)) {
    return invalid_param("top_p", "'top_p' must be greater than 0 and at most 1.", "invalid_value");
  }
  if (top_k && *top_k < -1) return invalid_param("top_k", "'top_k' must be -1, 0 (off) or positive.", "invalid_value");
  if (n && (*n < 1 || *n > limits.max_choices)) {
    return invalid_param("n", "'n' must be between 1 and " + std::to_string(limits.max_choices) + ".", "invalid_value");
  }
  if (top_logprobs && (*top_logprobs < 0 || *top_logprobs > 20)) {
    return invalid_param("top_logprobs", "'top_logprobs' must be between 0 and 20.", "invalid_value");
  }
  if (top_logprobs && *top_logprobs > 0 && !chat_logprobs.value_or(false)) {
    return invalid_param("top_logprobs", "'top_logprobs' requires 'logprobs' to be true.", "invalid_value");
  }
  if (completion_logprobs && (*completion_logprobs < 0 || *completion_logprobs > 5)) {
    return invalid_param("logprobs", "'logprobs' must be between 0 and 5.", "invalid_value");
  }
  if (echo.value_or(false) && completion_logprobs) {
    return invalid_param("echo", "'echo' with 'logprobs' needs the prompt tokens' log probabilities, which this server "
                                 "does not compute; ask for one of the two.", "unsupported_parameter");
  }
  req.echo = echo.value_or(false);
  {
    std::optional<int64_t> best_of;
    if ((err = read_int(body, "best_of", &best_of))) return *err;
    if (best_of) {
      if (*best_of < n.value_or(1) || *best_of > limits.max_choices)
        return invalid_param("best_of", "'best_of' must be at least 'n' (" + std::to_string(n.value_or(1)) +
                                            ") and at most " + std::to_string(limits.max_choices) + ".",
                             "invalid_value");
      if (*best_of > n.value_or(1) && stream.value_or(false))
        return invalid_param("best_of", "'best_of' above 'n' cannot be streamed: the best are known only at the end.",
                             "invalid_value");
      req.best_of = static_cast<int>(*best_of);
    }
  }

  if (const json* stop = member(body, "stop")) {
    if (stop->is_string()) {
      req.stop.push_back(stop->get<std::string>());
    } else if (stop->is_array()) {
      if (stop->size() > 4) return invalid_param("stop", "'stop' may hold at most 4 sequences.", "invalid_value");
      for (const json& s : *stop) {
        if (!s.is_string()) return *wrong_type("stop", "a string or an array of strings");
        req.stop.push_back(s.get<std::string>());
      }
    } else {
      return *wrong_type("stop", "a string or an array of strings");
    }
    for (const auto& s : req.stop) {
      if (s.empty()) return invalid_param("stop", "'stop' sequences must not be empty.", "invalid_value");
    }
  }

  if (const json* ids = member(body, "stop_token_ids")) {
    if (!ids->is_array()) return *wrong_type("stop_token_ids", "an array of token ids");
    if (ids->size() > 64) return invalid_param("stop_token_ids", "'stop_token_ids' may hold at most 64 ids.", "invalid_value");
    for (const json& t : *ids) {
      if (!t.is_number_integer()) return *wrong_type("stop_token_ids", "an array of token ids");
      const int64_t id = t.get<int64_t>();
      if (id < 0 || id >= codec.vocab_size())
        return invalid_param("stop_token_ids", "Token id " + std::to_string(id) +
                                                   " in 'stop_token_ids' is outside the vocabulary [0, " +
                                                   std::to_string(codec.vocab_size()) + ").", "invalid_value");
      req.stop_token_ids.push_back(static_cast<int32_t>(id));
    }
  }
  {
    std::optional<bool> ignore_eos;
    if ((err = read_bool(body, "ignore_eos", &ignore_eos))) return *err;
    req.ignore_eos = ignore_eos.value_or(false);
  }

  // Penalties, min_p, logit_bias and min_tokens (docs/sampling.md).
  {
    std::optional<double> presence, frequency, repetition, min_p;
    std::optional<int64_t> min_tokens;
    if ((err = read_number(body, "presence_penalty", &presence)) ||
        (err = read_number(body, "frequency_penalty", &frequency)) ||
        (err = read_number(body, "repetition_penalty", &repetition)) || (err = read_number(body, "min_p", &min_p)) ||
        (err = read_int(body, "min_tokens", &min_tokens)))
      return *err;
    for (auto [name, v] : {std::pair{"presence_penalty", presence}, std::pair{"frequency_penalty", frequency}})
      if (v && !(*v >= -2.0 && *v <= 2.0))
        return invalid_param(name, std::string("'") + name + "' must be between -2 and 2.", "invalid_value");
    // At most a factor of 100 either way: a smaller divisor overflows a
    // logit to infinity (from about 1e-37 on), a zero one is no penalty.
    if (repetition && !(*repetition >= 0.01 && *repetition <= 100.0))
      return invalid_param("repetition_penalty", "'repetition_penalty' must be between 0.01 and 100.",
                           "invalid_value");
    if (min_p && !(*min_p >= 0.0 && *min_p <= 1.0))
      return invalid_param("min_p", "'min_p' must be between 0 and 1.", "invalid_value");
    if (min_tokens && *min_tokens < 0)
      return invalid_param("min_tokens", "'min_tokens' must be at least 0.", "invalid_value");
    const std::optional<int64_t> max_asked = max_completion_tokens ? max_completion_tokens : max_tokens;
    if (min_tokens && max_asked && *min_tokens > *max_asked)
      return invalid_param("min_tokens", "'min_tokens' (" + std::to_string(*min_tokens) + ") must not exceed '" +
                                             (max_completion_tokens ? "max_completion_tokens" : "max_tokens") + "' (" +
                                             std::to_string(*max_asked) + ").",
                           "invalid_value");
    req.sampling.presence_penalty = static_cast<float>(presence.value_or(0.0));
    req.sampling.frequency_penalty = static_cast<float>(frequency.value_or(0.0));
    req.sampling.repetition_penalty = static_cast<float>(repetition.value_or(1.0));
    req.sampling.min_p = static_cast<float>(min_p.value_or(0.0));
    req.min_tokens = static_cast<int>(std::min<int64_t>(min_tokens.value_or(0), std::numeric_limits<int>::max()));

    if (const json* bias = member(body, "logit_bias")) {
      if (!bias->is_object()) return *wrong_type("logit_bias", "an object mapping token ids to biases");
      if (bias->size() > 1024)
        return invalid_param("logit_bias", "'logit_bias' may hold at most 1024 tokens.", "invalid_value");
      for (const auto& [key, value] : bias->items()) {
        int64_t id = -1;
        const bool digits = !key.empty() && key.size() <= 10 &&
                            std::all_of(key.begin(), key.end(), [](char ch) { return ch >= '0' && ch <= '9'; });
        if (digits) id = std::stoll(key);
        if (!digits || id >= codec.vocab_size())
          return invalid_param("logit_bias", "'logit_bias' key '" + key + "' is not a token id of the vocabulary [0, " +
                                                 std::to_string(codec.vocab_size()) + ").",
                               "invalid_value");
        if (!value.is_number() || !(value.get<double>() >= -100.0 && value.get<double>() <= 100.0))
          return invalid_param("logit_bias", "'logit_bias' values must be numbers between -100 and 100 (token " + key +
                                                 ").",
                               "invalid_value");
        req.logit_bias.emplace_back(static_cast<int32_t>(id), static_cast<float>(value.get<double>()));
      }
      std::sort(req.logit_bias.begin(), req.logit_bias.end());
      // "7" and "007" name one token.
      for (size_t i = 1; i < req.logit_bias.size(); ++i)
        if (req.logit_bias[i].first == req.logit_bias[i - 1].first)
          return invalid_param("logit_bias", "'logit_bias' names token " + std::to_string(req.logit_bias[i].first) +
                                                 " twice.",
                               "invalid_value");
    }
  }

  // response_format: free text, any JSON object, or a JSON schema's instances.
  if (const json* rf = member(body, "response_format")) {
    const char* P = "response_format";
    if (!rf->is_object() || !rf->contains("type") || !(*rf)["type"].is_string())
      return *wrong_type(P, "an object with a string 'type'");
    const std::string type = (*rf)["type"].get<std::string>();
    if (type == "json_object") {
      req.response_schema = structured::any_object_schema();
    } else if (type == "json_schema") {
      const auto js = rf->find("json_schema");
      if (js == rf->end() || !js->is_object())
        return invalid_param("response_format.json_schema", "'response_format.json_schema' must be an object.",
                             "invalid_type");
      const auto schema = js->find("schema");
      // No schema: any JSON value, as OpenAI's API takes it.
      auto compiled = structured::compile_json_schema(schema == js->end() ? json::object() : *schema);
      if (!compiled.ok())
        return invalid_param("response_format.json_schema.schema",
                             "'response_format.json_schema.schema': " + compiled.error() + ".", "invalid_value");
      req.response_schema = *compiled;
    } else if (type != "text") {
      return invalid_param(P, "'response_format.type' must be 'text', 'json_object' or 'json_schema', got '" + type + "'.",
                           "invalid_value");
    }
  }

  // Tools (chat): validated, described to the model by its template; a
  // choice of "required" or one function is enforced by a grammar.
  if (kind == ApiKind::chat) {
    if (auto e = parse_tools(body, codec, &req)) return *e;
  }
  // A grammar's whole value allows only the stop ids, which min_tokens would ban.
  if (req.response_schema && req.min_tokens > 0)
    return invalid_param("min_tokens", "'min_tokens' cannot be combined with 'response_format' or a forced 'tool_choice': "
                                       "the answer ends where its value does.", "invalid_value");
  // ... and which ignore_eos takes away: a finished value could not end.
  if (req.response_schema && req.ignore_eos)
    return invalid_param("ignore_eos", "'ignore_eos' cannot be combined with 'response_format' or a forced "
                                       "'tool_choice': the answer ends where its value does.", "invalid_value");

  if (const json* opts = member(body, "stream_options")) {
    if (!opts->is_object()) return *wrong_type("stream_options", "an object");
    if (!stream.value_or(false)) {
      return invalid_param("stream_options", "'stream_options' is only allowed when 'stream' is true.", "invalid_value");
    }
    std::optional<bool> include_usage;
    if (auto e = read_bool(*opts, "include_usage", &include_usage)) {
      e->param = "stream_options.include_usage";
      e->message = "'stream_options.include_usage' must be a boolean.";
      return *e;
    }
    req.include_usage = include_usage.value_or(false);
  }
  if (const json* user = member(body, "user")) {
    if (!user->is_string()) return *wrong_type("user", "a string");
    req.user = user->get<std::string>();
  }

  // The model, after the parameters' shapes, so that a typo'd model name on
  // an otherwise bad request reports the request's own mistake first.
  if (req.model != limits.served_model_name) {
    return ApiError{404, "The model '" + req.model + "' does not exist.", "invalid_request_error", "model",
                    "model_not_found"};
  }

  // truncate_prompt_tokens: keep only the last k tokens of each prompt.
  std::optional<int64_t> truncate;
  if ((err = read_int(body, "truncate_prompt_tokens", &truncate))) return *err;
  if (truncate && *truncate < 1)
    return invalid_param("truncate_prompt_tokens", "'truncate_prompt_tokens' must be at least 1.", "invalid_value");

  // The prompt(s), tokenised. A chat that would overflow the context loses
  // its oldest turns until the prompt leaves room for max_tokens (or, when
  // none is given, for an eighth of the context, at most 512 tokens).
  if (kind == ApiKind::chat) {
    int64_t fit = 0;
    // (max_tokens alone filling the context: nothing can fit, the check after refuses it.)
    if (limits.max_context > 0 && !truncate && !(max_tokens && *max_tokens >= limits.max_context)) {
      const int64_t reserve = max_tokens ? *max_tokens : std::max<int64_t>(1, std::min<int64_t>(limits.max_context / 8, 512));
      fit = std::max<int64_t>(1, limits.max_context - reserve);
    }
    // A KV cache smaller than the context: the history goes as far as the
    // cache holds, leaving the same room (a session's next turn still runs).
    if (limits.kv_capacity > 0 && !truncate && (fit == 0 || fit > limits.kv_capacity)) {
      const int64_t cap = limits.kv_capacity;
      const int64_t reserve = std::min<int64_t>(max_tokens ? *max_tokens : std::max<int64_t>(1, std::min<int64_t>(cap / 8, 512)),
                                                cap / 2);
      fit = std::min<int64_t>(fit == 0 ? cap : fit, std::max<int64_t>(1, cap - reserve));
    }
    if ((err = chat_prompt(body, codec, prior, &req.messages, &req.prompts, fit, &req.trimmed_messages,
                           &req.trimmed_tokens, req.tools)))
      return *err;
  } else {
    if ((err = completion_prompts(body, codec, &req.prompts))) return *err;
  }
  if (truncate) {
    for (auto& p : req.prompts) {
      if (static_cast<int64_t>(p.size()) > *truncate) {
        req.trimmed_tokens += static_cast<int64_t>(p.size()) - *truncate;
        p.erase(p.begin(), p.end() - *truncate);
      }
    }
  }
  const char* prompt_param = kind == ApiKind::chat ? "messages" : "prompt";
  req.n = static_cast<int>(n.value_or(1));
  if (static_cast<int64_t>(req.prompts.size()) * std::max(req.n, req.best_of) > limits.max_choices) {
    return invalid_param("n", "'n' times the number of prompts must be at most " + std::to_string(limits.max_choices) + ".",
                         "invalid_value");
  }

  size_t longest = 0;
  for (const auto& p : req.prompts) {
    if (p.empty()) return invalid_param(prompt_param, std::string("'") + prompt_param + "' is empty.", "invalid_value");
    longest = std::max(longest, p.size());
  }
  if (limits.kv_capacity > 0 && static_cast<int64_t>(longest) > limits.kv_capacity) {
    return invalid_param(prompt_param, "The server's KV cache holds " + std::to_string(limits.kv_capacity) +
                                           " tokens of one sequence. However, your prompt has " +
                                           std::to_string(longest) + " tokens.",
                         "context_length_exceeded");
  }
  if (limits.max_context > 0) {
    const int64_t ctx = limits.max_context;
    const int64_t room = ctx - static_cast<int64_t>(longest);  // tokens left for the completion
    if (room <= 0) {
      return invalid_param(prompt_param, "This model's maximum context length is " + std::to_string(ctx) +
                                             " tokens. However, your prompt has " + std::to_string(longest) +
                                             " tokens, which leaves no room for a completion.",
                           "context_length_exceeded");
    }
    // Compared as "more than the room", never as a sum: max_tokens may be near 2^63.
    if (max_tokens && *max_tokens > room) {
      return invalid_param(max_param, "This model's maximum context length is " + std::to_string(ctx) +
                                          " tokens. However, you requested " + std::to_string(longest) + " + " +
                                          std::to_string(*max_tokens) + " tokens (" + std::to_string(longest) +
                                          " in the prompt, " + std::to_string(*max_tokens) + " for the completion).",
                           "context_length_exceeded");
    }
    req.max_new_tokens = static_cast<int>(max_tokens ? *max_tokens : room);
    // Without max_tokens (with it, min ≤ max ≤ room was checked): the
    // tokens asked for at least must fit too.
    if (req.min_tokens > room) {
      return invalid_param("min_tokens", "This model's maximum context length is " + std::to_string(ctx) +
                                             " tokens. However, you asked for at least " +
                                             std::to_string(req.min_tokens) + " tokens after a prompt of " +
                                             std::to_string(longest) + " tokens, which leaves room for " +
                                             std::to_string(room) + ".",
                           "context_length_exceeded");
    }
  } else {
    req.max_new_tokens = max_tokens ? static_cast<int>(std::min<int64_t>(*max_tokens, std::numeric_limits<int>::max()))
                                    : std::numeric_limits<int>::max();
  }
  req.max_tokens_given = max_tokens.has_value();

  req.sampling.temperature = static_cast<float>(temperature.value_or(1.0));
  // A top_p below the smallest float still means "the best token alone":
  // it must not round to 0, which the worker refuses.
  req.sampling.top_p = std::max(static_cast<float>(top_p.value_or(1.0)), std::numeric_limits<float>::min());
  req.sampling.top_k = top_k && *top_k > 0 ? static_cast<uint32_t>(std::min<int64_t>(*top_k, std::numeric_limits<int>::max())) : 0;
  req.seed_given = seed.has_value();
  req.sampling.seed = static_cast<uint64_t>(seed.value_or(0));
  if (kind == ApiKind::chat) {
    req.sampling.logprobs = chat_logprobs.value_or(false);
    req.sampling.top_logprobs = req.sampling.logprobs ? static_cast<uint8_t>(top_logprobs.value_or(0)) : 0;
  } else {
    req.sampling.logprobs = completion_logprobs.has_value();
    req.sampling.top_logprobs = static_cast<uint8_t>(completion_logprobs.value_or(0));
  }
  req.stream = stream.value_or(false);

  // What the request costs at most, before anything runs (unknown while no
  // worker said how long its context is and the request names no max_tokens).
  if (limits.max_context == 0 && !max_tokens) return req;
  const int64_t choices = static_cast<int64_t>(req.prompts.size()) * std::max(req.n, req.best_of);
  const int64_t tokens = choices * req.max_new_tokens;  // ≤ 128 × 2^31: no overflow
  if (tokens > limits.max_request_tokens) {
    // (said as asked: max_tokens past 2^31 was clamped only for the arithmetic)
    const std::string each = max_tokens ? std::to_string(*max_tokens) : std::to_string(req.max_new_tokens);
    const std::string total = max_tokens && *max_tokens > req.max_new_tokens
                                  ? "more than " + std::to_string(tokens)
                                  : std::to_string(tokens);
    return invalid_param(max_tokens ? max_param : "n",
                         "This request may generate " + std::to_string(choices) + " x " + each + " = " + total +
                             " tokens, more than the server's limit of " + std::to_string(limits.max_request_tokens) +
                             " per request; lower 'n' or '" + max_param + "'.",
                         "request_too_costly");
  }
  if (req.sampling.logprobs && !req.stream) {
    const int64_t entries = tokens * (1 + req.sampling.top_logprobs);
    if (entries > limits.max_logprob_entries) {
      return invalid_param(kind == ApiKind::chat ? "top_logprobs" : "logprobs",
                           "A whole response with these logprobs may hold " + std::to_string(entries) +
                               " entries (choices x max tokens x (1 + alternatives)), more than the server's limit of " +
                               std::to_string(limits.max_logprob_entries) +
                               "; lower 'n', '" + max_param + "' or the alternatives, or stream the response.",
                           "request_too_costly");
    }
  }
  return req;
}

}  // namespace moe::gw
