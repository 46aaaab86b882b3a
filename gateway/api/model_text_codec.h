#pragma once
// The gateway's TextCodec: the model's tokenizer.json, its chat template
// (chat_template.jinja or tokenizer_config.json's "chat_template") and its
// stop ids (config.json / generation_config.json EOS, the tokenizer's EOS).

#include <memory>
#include <string>

#include "gateway/api/text_codec.h"
#include "model/result.h"

namespace moe::gw {

// `model_path`: a checkpoint folder, or a packed model file holding the
// tokenizer files.
Result<std::unique_ptr<TextCodec>> load_model_text_codec(const std::string& model_path);

}  // namespace moe::gw
