#pragma once
// Decoders of tokenizer.json ("decoder"): ByteLevel, Replace, ByteFallback,
// Fuse, Strip, Metaspace, Sequence. Each rewrites the list of token strings;
// decode() joins what the chain leaves.

#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "model/result.h"

namespace moe::tok {

class Decoder {
 public:
  virtual ~Decoder() = default;
  virtual void decode_chain(std::vector<std::string>& tokens) const = 0;
};

// A null spec gives a null pointer: tokens are then joined with spaces.
Result<std::unique_ptr<Decoder>> make_decoder(const nlohmann::json& spec);

}  // namespace moe::tok
