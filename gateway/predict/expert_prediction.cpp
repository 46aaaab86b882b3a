#include "gateway/predict/expert_prediction.h"

#include <cstdio>

#include "model/model_files.h"

namespace moe::gw {

const char* source_name(ExpertFrequencyTable::Source s) {
  switch (s) {
    case ExpertFrequencyTable::Source::bucket:
      return "bucket";
    case ExpertFrequencyTable::Source::nearest:
      return "nearest";
    case ExpertFrequencyTable::Source::global:
      return "global";
    case ExpertFrequencyTable::Source::none:
      break;
  }
  return "none";
}

Result<std::unique_ptr<PromptExpertPredictor>> PromptExpertPredictor::open(
    const std::string& model_path, PredictorOptions opts) {
  auto files = ModelFiles::open(model_path);
  if (!files.ok()) return make_error(files.error());
  const ModelDesc& d = files.value()->desc();
  if (d.n_moe_layers() <= 0 || d.moe.n_experts <= 0)
    return make_error(model_path + " has no MoE layers: nothing to predict");
  auto emb = PromptEmbedder::open(model_path);
  if (!emb.ok()) return make_error(emb.error());
  return std::make_unique<PromptExpertPredictor>(std::move(emb.value()), d.n_moe_layers(),
                                                 d.moe.n_experts, opts);
}

PromptExpertPredictor::PromptExpertPredictor(std::unique_ptr<PromptEmbedder> embedder,
                                             int n_moe_layers, int n_experts, PredictorOptions opts)
    : embedder_(std::move(embedder)),
      hasher_(embedder_->dim(), opts.lsh_bits, opts.lsh_seed),
      opts_(opts),
      table_(n_moe_layers, n_experts, opts.table) {
  // FNV-1a over (seed, bits): gateways started alike agree on it.
  uint64_t h = 0xcbf29ce484222325ull;
  auto mix = [&h](uint64_t v) {
    for (int i = 0; i < 8; ++i) {
      h ^= (v >> (8 * i)) & 0xff;
      h *= 0x100000001b3ull;
    }
  };
  mix(opts_.lsh_seed);
  mix(uint64_t(hasher_.bits()));
  scheme_ = uint32_t(h ^ (h >> 32)) & 0x7fffffffu;
}

uint32_t PromptExpertPredictor::bucket_of(std::span<const int32_t> tokens) const {
  return hasher_.bucket(embedder_->embed(tokens));
}

ExpertPrediction PromptExpertPredictor::predict(std::span<const int32_t> tokens) const {
  return predict_bucket(bucket_of(tokens));
}

ExpertPrediction PromptExpertPredictor::predict_bucket(uint32_t bucket) const {
  ExpertPrediction out;
  out.bucket = bucket;
  out.tag = tag_of(bucket);
  auto est = table_.estimate(bucket);
  out.source = est.source;
  out.from_bucket = est.bucket;
  out.distance = est.distance;
  out.experts = ExpertFrequencyTable::top_experts(est, n_experts(), opts_.experts_per_layer);
  out.set = ExpertSet(size_t(n_layers()) * size_t(n_experts()));
  for (size_t l = 0; l < out.experts.size(); ++l)
    for (int e : out.experts[l]) out.set.add(l * size_t(n_experts()) + size_t(e));
  out.p = std::move(est.p);
  return out;
}

bool PromptExpertPredictor::bucket_of_tag(uint64_t tag, uint32_t* bucket) const {
  if (!(tag >> 63) || uint32_t((tag >> 32) & 0x7fffffffu) != scheme_) return false;
  *bucket = uint32_t(tag);
  return true;
}

void PromptExpertPredictor::learn_summary(uint64_t bucket_tag, const std::string& layers) {
  uint32_t bucket = 0;
  if (!bucket_of_tag(bucket_tag, &bucket)) {
    ++stats_.summaries_foreign;
    return;
  }
  auto usage = parse_routing_layers(layers, n_layers(), n_experts());
  if (!usage.ok()) {
    ++stats_.summaries_bad;
    std::fprintf(stderr, "moe-gateway: skipping a routing summary: %s\n", usage.error().c_str());
    return;
  }
  learn(bucket, usage.value());
}

void PromptExpertPredictor::learn(uint32_t bucket, std::span<const float> usage) {
  table_.learn(bucket, usage);
  ++stats_.summaries_learned;
}

void PromptExpertPredictor::score(const ExpertPrediction& pred, std::span<const float> usage) {
  if (!pred.known() || usage.size() != size_t(n_layers()) * size_t(n_experts())) return;
  ++stats_.requests_scored;
  for (size_t l = 0; l < pred.experts.size(); ++l)
    for (int e : pred.experts[l]) {
      ++stats_.predicted;
      if (usage[l * size_t(n_experts()) + size_t(e)] > 0) ++stats_.hits;
    }
}

PredictionStats PromptExpertPredictor::stats() const {
  PredictionStats s = stats_;
  s.buckets = table_.buckets();
  return s;
}

}  // namespace moe::gw
