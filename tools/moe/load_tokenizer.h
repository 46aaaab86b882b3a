#pragma once
// The tokenizer of a model path for the command-line tool: a folder holding
// tokenizer.json (and tokenizer_config.json), or a packed model file.

#include <memory>
#include <string>

#include "model/result.h"
#include "tokenizer/tokenizer.h"

namespace moe::cli {

Result<std::unique_ptr<Tokenizer>> load_tokenizer(const std::string& path);

}  // namespace moe::cli
