#pragma once
// A prompt's cheap embedding and its locality-sensitive hash
// (docs/expert-prediction.md).
//
// PromptEmbedder: the mean of the model's own input-embedding rows
// (`model.embed_tokens.weight`, read from the mapped checkpoint, never
// copied) over the prompt's token ids, minus the mean row of the whole table,
// so that hyperplanes through the origin cut between prompts rather than all
// on one side of an offset every row shares.
//
// LshHasher: `bits` random hyperplanes (normal entries from a seeded
// generator); bit i of the bucket says on which side of plane i the vector
// lies. Vectors at a small angle share most bits, so similar prompts land in
// the same bucket or one a few bits away.
//
// Threading: both are immutable after construction; any thread.

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "model/model_files.h"
#include "model/result.h"

namespace moe::gw {

class PromptEmbedder {
 public:
  // The embedding table of the model at `model_path` (folder or packed file).
  static Result<std::unique_ptr<PromptEmbedder>> open(const std::string& model_path);
  // Over a table given directly (tests): [vocab, dim] row-major.
  PromptEmbedder(std::vector<float> table, int vocab, int dim);

  int dim() const { return dim_; }
  int vocab() const { return vocab_; }
  // Tokens a prompt's embedding reads at most: a longer prompt is sampled
  // evenly across its length, so the cost on the gateway's loop is bounded
  // (kMaxTokens × dim adds) whatever the prompt.
  static constexpr size_t kMaxTokens = 512;
  // Mean row of `tokens` minus the table's mean row; ids out of range are
  // skipped; an empty (or all-invalid) prompt gives the zero vector.
  std::vector<float> embed(std::span<const int32_t> tokens) const;  // [dim]

 private:
  PromptEmbedder() = default;
  void compute_center();
  // acc[c] += row[c]; `scratch` holds dim 16-bit values.
  void add_row(int64_t row, float* acc, uint16_t* scratch) const;

  std::shared_ptr<ModelFiles> files_;  // keeps the mapping alive
  const TensorView* view_ = nullptr;   // [vocab, dim], bf16/f16/f32 as stored
  std::vector<float> owned_;           // the table when given directly
  int vocab_ = 0, dim_ = 0;
  std::vector<float> center_;  // [dim]: mean row of the table
};

class LshHasher {
 public:
  static constexpr int kMaxBits = 32;
  // `bits` in 1..kMaxBits hyperplanes of dimension `dim`, from `seed`.
  LshHasher(int dim, int bits, uint64_t seed);

  int bits() const { return bits_; }
  uint64_t seed() const { return seed_; }
  // Bit i set when the vector is on the positive side of plane i.
  uint32_t bucket(std::span<const float> v) const;

 private:
  int dim_, bits_;
  uint64_t seed_;
  std::vector<float> planes_;  // [bits, dim]
};

inline int hamming(uint32_t a, uint32_t b) { return __builtin_popcount(a ^ b); }

}  // namespace moe::gw
