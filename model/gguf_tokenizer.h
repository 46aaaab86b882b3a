#pragma once
// A GGUF file's tokenizer (tokenizer.ggml.*) and chat template
// (tokenizer.chat_template) as the tokenizer.json and tokenizer_config.json
// texts our tokenizer reads, so a .gguf serves with nothing beside it.
// Byte-level BPE vocabularies ("gpt2") carry their merges and name their
// pre-tokenizer; SentencePiece ones ("llama") carry scores, from which the
// merges are ranked (docs/gguf.md).

#include <cstdint>
#include <string>
#include <vector>

#include "model/gguf_file.h"
#include "model/result.h"

namespace moe {

struct GgufTokenizerFiles {
  std::string tokenizer_json;
  std::string tokenizer_config_json;
  std::vector<int32_t> eos_ids;  // eos, then eot / eom where they differ
  int32_t bos_id = -1;
};

[[nodiscard]] Result<GgufTokenizerFiles> gguf_tokenizer_files(const GgufFile& g);

// The pre-tokenizer names (tokenizer.ggml.pre) whose splitting rules are known.
const std::vector<std::string>& gguf_known_pre_tokenizers();

}  // namespace moe
