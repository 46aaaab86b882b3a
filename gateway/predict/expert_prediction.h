#pragma once
// Expert prediction from prompt-embedding hashes (docs/expert-prediction.md):
// a prompt's token ids → PromptEmbedder → LshHasher bucket →
// ExpertFrequencyTable → the experts each MoE layer is likely to use. The
// table learns from routing summaries (the workers' Redis stream, or this
// gateway's own step replies when there is no Redis); the same object scores
// each finished request's prediction against what it really used (metrics).
//
// The bucket travels to the worker as a tag (StepSequence.route_bucket) and
// comes back in the routing summary: bit 63 set, bits 32..62 a digest of the
// LSH settings (seed, bits), bits 0..31 the bucket. A summary whose tag was
// made under other settings (another gateway started with other flags) is
// counted as foreign and not learned, since its buckets mean something else.
//
// Threading: loop thread only.

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "gateway/predict/expert_frequency_table.h"
#include "gateway/predict/expert_set.h"
#include "gateway/predict/prompt_embedding.h"
#include "model/result.h"

namespace moe::gw {

struct PredictorOptions {
  int lsh_bits = 12;
  uint64_t lsh_seed = 1;
  int experts_per_layer = 8;  // predicted (and warm-hinted) experts per MoE layer
  FrequencyTableParams table;
};

struct ExpertPrediction {
  uint32_t bucket = 0;
  uint64_t tag = 0;  // for StepSequence.route_bucket
  ExpertFrequencyTable::Source source = ExpertFrequencyTable::Source::none;
  uint32_t from_bucket = 0;  // the table row used
  int distance = 0;          // Hamming distance to it
  std::vector<std::vector<int>>
      experts;           // [moe layer][rank], best first; empty: nothing learned yet
  std::vector<float> p;  // [layer * n_experts + expert]: estimated share of tokens
  ExpertSet set;         // `experts` as a set
  bool known() const { return !set.empty(); }
};

struct PredictionStats {
  uint64_t requests_scored = 0;  // finished requests whose prediction was checked
  uint64_t predicted = 0;        // experts predicted for them
  uint64_t hits = 0;             // of those, used by at least one of the request's tokens
  uint64_t summaries_learned = 0;
  uint64_t summaries_foreign = 0;  // made under other LSH settings, or without a bucket
  uint64_t summaries_bad = 0;      // did not parse
  uint64_t buckets = 0;            // buckets the table holds
};

const char* source_name(ExpertFrequencyTable::Source s);

class PromptExpertPredictor {
 public:
  // The model's embedding table and layout from `model_path`.
  static Result<std::unique_ptr<PromptExpertPredictor>> open(const std::string& model_path,
                                                             PredictorOptions opts);
  PromptExpertPredictor(std::unique_ptr<PromptEmbedder> embedder, int n_moe_layers, int n_experts,
                        PredictorOptions opts);

  int n_layers() const { return table_.n_layers(); }
  int n_experts() const { return table_.n_experts(); }
  const PredictorOptions& options() const { return opts_; }

  uint32_t bucket_of(std::span<const int32_t> tokens) const;
  ExpertPrediction predict(std::span<const int32_t> tokens) const;
  ExpertPrediction predict_bucket(uint32_t bucket) const;

  uint64_t tag_of(uint32_t bucket) const {
    return (uint64_t(1) << 63) | (uint64_t(scheme_) << 32) | bucket;
  }
  // The bucket of a tag made under this predictor's settings.
  bool bucket_of_tag(uint64_t tag, uint32_t* bucket) const;

  // One routing summary from the stream: `bucket_tag` as the worker
  // published it (0: none), `layers` in its text form.
  void learn_summary(uint64_t bucket_tag, const std::string& layers);
  // One request's use, tokens per [layer * n_experts + expert].
  void learn(uint32_t bucket, std::span<const float> usage);
  // A finished request: how much of its prediction it really used.
  void score(const ExpertPrediction& pred, std::span<const float> usage);

  PredictionStats stats() const;
  const ExpertFrequencyTable& table() const { return table_; }

 private:
  std::unique_ptr<PromptEmbedder> embedder_;
  LshHasher hasher_;
  PredictorOptions opts_;
  ExpertFrequencyTable table_;
  uint32_t scheme_ = 0;  // 31-bit digest of (seed, bits)
  PredictionStats stats_;
};

}  // namespace moe::gw
