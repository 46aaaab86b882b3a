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
  // The same, leaving broken UTF-8 as it is: the bytes tokens stand for,
  // where one may hold part of a character (logprobs' "bytes").
  virtual void decode_chain_raw(std::vector<std::string>& tokens) const { decode_chain(tokens); }
};

// A null spec gives a null pointer: tokens are then joined with spaces.
Result<std::unique_ptr<Decoder>> make_decoder(const nlohmann::json& spec);

}  // namespace moe::tok
