#pragma once
// POST /debug/experts: what the gateway predicts for a prompt, without
// running it (docs/expert-prediction.md). Body: {"prompt": "text"} (encoded
// as /v1/completions does) or {"messages": [...]} (through the chat template,
// as /v1/chat/completions does). Answer: the bucket, where the estimate came
// from, the predicted experts per MoE layer with their estimated shares, the
// table's size, and how well each worker's published resident set matches.
//
// Threading: loop thread only.

#include <map>
#include <string>

#include "gateway/api_error.h"
#include "gateway/predict/expert_prediction.h"
#include "gateway/http/http_server.h"
#include "gateway/api/text_codec.h"

namespace moe::gw {

// `resident`: worker name → resident set text, as read from Redis (may be empty).
HttpResponse expert_prediction_response(const std::string& body, const TextCodec& codec,
                                        const PromptExpertPredictor& predictor,
                                        const std::map<std::string, std::string>& resident);

}  // namespace moe::gw
