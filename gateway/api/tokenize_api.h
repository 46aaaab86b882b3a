#pragma once
// POST /tokenize and POST /detokenize, in the shapes other OpenAI-compatible
// servers give them (vLLM's), so that clients can count and inspect tokens
// with the served model's own tokenizer and chat template:
//   /tokenize   {"model"?, "prompt": "text"} or {"model"?, "messages": [...]},
//               "return_token_strs"?: bool
//            -> {"count", "max_model_len", "tokens", "token_strs"}
//   /detokenize {"model"?, "tokens": [ids]} -> {"prompt": "text"}
// A prompt is encoded as /v1/completions encodes it, messages as
// /v1/chat/completions renders them (the template, generation prompt on).
// Nothing runs on a worker.
//
// Threading: loop thread only.

#include <cstdint>
#include <string>

#include "gateway/api/text_codec.h"
#include "gateway/http/http_server.h"

namespace moe::gw {

// max_context: the workers' context length, 0 while none has said (then
// "max_model_len" is null).
HttpResponse tokenize_response(const std::string& body, const TextCodec& codec, const std::string& served_model,
                               int64_t max_context);
HttpResponse detokenize_response(const std::string& body, const TextCodec& codec, const std::string& served_model);

}  // namespace moe::gw
