#include "gateway/api/tokenize_api.h"

#include <cstdint>
#include <optional>

#include "gateway/api/completion_request.h"
#include "gateway/api/parameter_support.h"
#include "gateway/api_error.h"
#include "gateway/json_body.h"

namespace moe::gw {
namespace {

using json = nlohmann::json;

HttpResponse json_response(const json& j) {
  HttpResponse r;
  r.headers = {{"Content-Type", "application/json"}};
  r.body = json_text(j);
  return r;
}

// The body as an object whose "model", when given, is the served one.
std::optional<ApiError> check_body(const ParsedJson& parsed, const std::string& served_model) {
  if (auto* err = std::get_if<ApiError>(&parsed)) return *err;
  const json& body = std::get<json>(parsed);
  if (!body.is_object()) return ApiError{400, "The request body must be a JSON object.", "invalid_request_error", "", "invalid_json"};
  auto m = body.find("model");
  if (m != body.end() && !m->is_null()) {
    if (!m->is_string()) return invalid_param("model", "'model' must be a string.", "invalid_type");
    if (m->get<std::string>() != served_model)
      return ApiError{404, "The model '" + m->get<std::string>() + "' does not exist.", "invalid_request_error", "model",
                      "model_not_found"};
  }
  return std::nullopt;
}

std::optional<ApiError> refuse_flag(const json& body, const char* key, bool accepted) {
  auto it = body.find(key);
  if (it == body.end() || it->is_null()) return std::nullopt;
  if (!it->is_boolean()) return invalid_param(key, std::string("'") + key + "' must be a boolean.", "invalid_type");
  if (it->get<bool>() != accepted)
    return invalid_param(key, std::string("'") + key + "' other than " + (accepted ? "true" : "false") +
                                  " is not supported.", "unsupported_parameter");
  return std::nullopt;
}

}  // namespace

HttpResponse tokenize_response(const std::string& text, const TextCodec& codec, const std::string& served_model,
                               int64_t max_context) {
  ParsedJson parsed = parse_json_body(text);
  if (auto err = check_body(parsed, served_model)) return api_error_response(*err);
  const json& body = std::get<json>(parsed);
  bool token_strs = false;
  if (auto it = body.find("return_token_strs"); it != body.end() && !it->is_null()) {
    if (!it->is_boolean()) return api_error_response(invalid_param("return_token_strs", "'return_token_strs' must be a boolean.", "invalid_type"));
    token_strs = it->get<bool>();
  }
  std::vector<int32_t> ids;
  const bool has_prompt = body.contains("prompt") && !body["prompt"].is_null();
  const bool has_messages = body.contains("messages") && !body["messages"].is_null();
  if (has_prompt == has_messages)
    return api_error_response(invalid_param(has_prompt ? "messages" : "prompt",
                                            "Give exactly one of 'prompt' (a string) and 'messages'.",
                                            has_prompt ? "invalid_value" : "missing_required_parameter"));
  if (has_prompt) {
    if (!body["prompt"].is_string())
      return api_error_response(invalid_param("prompt", "'prompt' must be a string.", "invalid_type"));
    // The tokenizer's own special tokens, as /v1/completions encodes.
    if (auto err = refuse_flag(body, "add_special_tokens", true)) return api_error_response(*err);
    ids = codec.encode(body["prompt"].get<std::string>());
  } else {
    if (auto err = refuse_flag(body, "add_generation_prompt", true)) return api_error_response(*err);
    if (auto err = refuse_flag(body, "continue_final_message", false)) return api_error_response(*err);
    // What /v1/chat/completions refuses is refused here too, and its
    // template variables and tools count.
    if (auto err = refuse_unsupported(ApiKind::chat, body)) return api_error_response(*err);
    json kwargs;
    if (auto err = parse_template_kwargs(body, &kwargs)) return api_error_response(*err);
    if (body.contains("tools") && !body["tools"].is_null()) {
      if (!body["tools"].is_array())
        return api_error_response(invalid_param("tools", "'tools' must be an array of tools.", "invalid_type"));
      if (!body["tools"].empty()) {
        if (codec.tool_format() == TextCodec::ToolFormat::none)
          return api_error_response(invalid_param("tools", "This model's chat template does not describe tools.",
                                                  "unsupported_parameter"));
        kwargs["tools"] = body["tools"];
      }
    }
    ChatMessages messages;
    if (auto err = parse_chat_messages(body, &messages)) return api_error_response(*err);
    if (codec.tool_format() == TextCodec::ToolFormat::none)
      for (size_t i = 0; i < messages.size(); ++i)
        if (!messages[i].tool_calls.empty())
          return api_error_response(invalid_param("messages[" + std::to_string(i) + "].tool_calls",
                                                  "This model's chat template does not render tool calls.",
                                                  "unsupported_parameter"));
    auto encoded = codec.encode_chat(template_messages({}, messages), kwargs);
    if (!encoded.ok())
      return api_error_response(invalid_param("messages", "The chat template rejected the messages: " + encoded.error()));
    ids = std::move(encoded.value());
  }
  json out = {{"count", ids.size()},
              {"max_model_len", max_context > 0 ? json(max_context) : json(nullptr)},
              {"tokens", ids},
              {"token_strs", nullptr}};
  if (token_strs) {
    json strs = json::array();
    for (int32_t id : ids) strs.push_back(codec.token_bytes(id));  // json_text replaces broken UTF-8
    out["token_strs"] = std::move(strs);
  }
  return json_response(out);
}

HttpResponse detokenize_response(const std::string& text, const TextCodec& codec, const std::string& served_model) {
  ParsedJson parsed = parse_json_body(text);
  if (auto err = check_body(parsed, served_model)) return api_error_response(*err);
  const json& body = std::get<json>(parsed);
  auto it = body.find("tokens");
  if (it == body.end() || it->is_null())
    return api_error_response(invalid_param("tokens", "Missing required parameter: 'tokens'.", "missing_required_parameter"));
  if (!it->is_array()) return api_error_response(invalid_param("tokens", "'tokens' must be an array of token ids.", "invalid_type"));
  auto dec = codec.stream_decoder();
  std::string out;
  for (const json& t : *it) {
    if (!t.is_number_integer())
      return api_error_response(invalid_param("tokens", "'tokens' must be an array of token ids.", "invalid_type"));
    // An id past int64 (JSON's unsigned 2^63 and up) is out of range too,
    // and said as sent.
    const bool huge = t.is_number_unsigned() && t.get<uint64_t>() > uint64_t(INT64_MAX);
    const int64_t id = huge ? -1 : t.get<int64_t>();
    if (huge || id < 0 || id >= codec.vocab_size())
      return api_error_response(invalid_param("tokens", "Token id " + (huge ? std::to_string(t.get<uint64_t>()) : std::to_string(id)) +
                                                            " is outside the vocabulary [0, " +
                                                            std::to_string(codec.vocab_size()) + ").", "invalid_value"));
    out += dec->push(static_cast<int32_t>(id));
  }
  out += dec->flush();
  return json_response(json{{"prompt", out}});
}

}  // namespace moe::gw
