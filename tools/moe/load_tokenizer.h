#pragma once
// The tokenizer of a model path for the command-line tool: a folder holding
// tokenizer.json (and tokenizer_config.json), or a packed model file.

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "model/result.h"
#include "tokenizer/tokenizer.h"

namespace moe::cli {

Result<std::unique_ptr<Tokenizer>> load_tokenizer(const std::string& path);
// The token ids of text file `file` under `model`'s tokenizer (special
// tokens written in it recognised, the post-processor's additions made):
// what `perplexity`, `profile --text` and `layer-ahead` read.
Result<std::vector<int32_t>> text_file_ids(const std::string& model, const std::string& file);

}  // namespace moe::cli
