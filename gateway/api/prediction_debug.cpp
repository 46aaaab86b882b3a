#include "gateway/api/prediction_debug.h"

#include <nlohmann/json.hpp>

#include "gateway/api/completion_request.h"
#include "gateway/json_body.h"
#include "gateway/sched/worker_choice.h"

namespace moe::gw {

HttpResponse expert_prediction_response(const std::string& body, const TextCodec& codec,
                                        const PromptExpertPredictor& predictor,
                                        const std::map<std::string, std::string>& resident) {
  using json = nlohmann::json;
  ParsedJson parsed = parse_json_body(body);
  if (auto* err = std::get_if<ApiError>(&parsed)) return api_error_response(*err);
  const json& in = std::get<json>(parsed);
  if (!in.is_object())
    return api_error_response(ApiError{400, "The body is not a JSON object.",
                                       "invalid_request_error", "", "invalid_json"});
  std::vector<int32_t> tokens;
  if (in.contains("prompt") && in["prompt"].is_string()) {
    tokens = codec.encode(in["prompt"].get<std::string>());
  } else if (in.contains("messages")) {
    ChatMessages messages;
    if (auto err = parse_chat_messages(in, &messages)) return api_error_response(*err);
    auto t = codec.encode_chat(template_messages({}, messages));
    if (!t.ok()) return api_error_response(invalid_param("messages", t.error(), "invalid_value"));
    tokens = std::move(t.value());
  } else {
    return api_error_response(ApiError{400, "Give 'prompt' (a string) or 'messages' (an array).",
                                       "invalid_request_error", "prompt",
                                       "missing_required_parameter"});
  }
  const ExpertPrediction pred = predictor.predict(tokens);
  const size_t E = size_t(predictor.n_experts());
  json layers = json::array();
  for (size_t l = 0; l < pred.experts.size(); ++l) {
    json experts = json::array(), shares = json::array();
    for (int e : pred.experts[l]) {
      experts.push_back(e);
      shares.push_back(pred.p[l * E + size_t(e)]);
    }
    layers.push_back({{"layer", l}, {"experts", experts}, {"shares", shares}});
  }
  json workers = json::array();
  for (const auto& [name, text] : resident) {
    // Names come from Redis: whatever bytes they hold, json_text replaces.
    const ExpertSet set = parse_resident_set(text, predictor.n_layers(), predictor.n_experts());
    workers.push_back(
        {{"worker", name}, {"resident", set.count()}, {"match", prediction_match(pred, set, E)}});
  }
  const PredictionStats st = predictor.stats();
  json out = {{"prompt_tokens", tokens.size()},
              {"bucket", pred.bucket},
              {"route_bucket", pred.tag},
              {"source", source_name(pred.source)},
              {"from_bucket", pred.from_bucket},
              {"distance", pred.distance},
              {"layers", layers},
              {"buckets_known", st.buckets},
              {"summaries_learned", st.summaries_learned},
              {"workers", workers}};
  HttpResponse r;
  r.status = 200;
  r.headers = {{"Content-Type", "application/json"}};
  r.body = json_text(out);
  return r;
}

}  // namespace moe::gw
