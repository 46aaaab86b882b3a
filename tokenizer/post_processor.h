#pragma once
// Post-processors of tokenizer.json ("post_processor"), applied by
// encode(add_special_tokens=true) to a single sequence: TemplateProcessing,
// RobertaProcessing, BertProcessing, ByteLevel (no change to ids), Sequence.

#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <vector>

#include "model/result.h"

namespace moe::tok {

class PostProcessor {
 public:
  virtual ~PostProcessor() = default;
  virtual void process(std::vector<int32_t>& ids) const = 0;
};

// A null spec gives a null pointer (ids unchanged).
Result<std::unique_ptr<PostProcessor>> make_post_processor(const nlohmann::json& spec);

// prefix + ids + suffix: what add_bos_token / add_eos_token ask for.
std::unique_ptr<PostProcessor> make_wrap_processor(std::vector<int32_t> prefix,
                                                   std::vector<int32_t> suffix);

}  // namespace moe::tok
