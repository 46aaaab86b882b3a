#include "engine/cpu_engine.h"

#include <algorithm>
#include <string>
#include <unordered_set>

#include "kernels/cpu/sampling.h"

namespace moe {

Result<std::unique_ptr<CpuEngine>> CpuEngine::create(std::shared_ptr<ModelFiles> files,
                                                     const EngineOptions& opts) {
  if (!files) return make_error("no model");
  if (opts.kv_block_tokens < 1) return make_error("kv_block_tokens must be at least 1");
  const ModelDesc& d = files->desc();
  const bool use_q4 = opts.experts_q4.value_or(files->experts_q4());
  if (use_q4 && !files->experts_q4())
    return make_error("INT4 experts requested but '" + files->path() + "' has none");

  std::unique_ptr<CpuEngine> e(new CpuEngine());
  e->files_ = files;
  const bool convert = f32_weight_bytes(*files) <= opts.f32_weights_max_bytes;
  auto w = load_weights(*files, convert, use_q4);
  if (!w) return make_error(files->path() + ": " + w.error());
  e->weights_ = std::move(w.value());
  e->pool_ = std::make_unique<cpu::ThreadPool>(opts.threads);

  const int nkv = ForwardPass::kv_heads(d), qk = ForwardPass::kv_qk_dim(d),
            vd = ForwardPass::kv_v_dim(d);
  int blocks = opts.kv_blocks;
  if (blocks <= 0) {
    const size_t per_block = KvCache::block_bytes(d.n_layers, opts.kv_block_tokens, nkv, qk, vd, opts.kv_dtype);
    blocks = int(std::min<size_t>(opts.kv_bytes_budget / per_block, size_t(1) << 30));
  }
  if (blocks < 1) return make_error("the KV budget holds no block");
  e->kv_ = std::make_unique<KvCache>(d.n_layers, blocks, opts.kv_block_tokens, nkv, qk, vd, opts.kv_dtype);
  e->kv_pool_ = std::make_unique<KvBlockPool>(blocks, opts.kv_block_tokens);
  e->prefix_cache_ = opts.prefix_cache;
  e->max_context_ = d.max_position > 0 ? d.max_position : blocks * opts.kv_block_tokens;
  e->pass_ = std::make_unique<ForwardPass>(e->files_->desc(), *e->weights_, *e->kv_, *e->pool_);
  return e;
}

void CpuEngine::set_progress(std::atomic<uint64_t>* progress) { pass_->set_progress(progress); }

Result<std::vector<SeqOutput>> CpuEngine::step(std::span<const SeqInput> inputs) {
  const ModelDesc& d = desc();
  // Validate everything before touching any state.
  const Status checked = check_step_inputs(inputs, *kv_pool_, d.vocab_size, max_context_);
  if (!checked.ok()) return make_error(checked.error());
  kv_pool_->release_restarts(inputs);  // their blocks count for the inputs before them
  // Fresh prompts that start with cached blocks compute only the rest.
  std::vector<SeqInput> reused;
  std::vector<int> skipped;
  if (prefix_cache_) inputs = kv_pool_->reuse_prefixes(inputs, &reused, &skipped);

  Batch b;
  std::vector<size_t> logit_of(inputs.size(), SIZE_MAX);
  for (size_t i = 0; i < inputs.size(); ++i) {
    const SeqInput& in = inputs[i];
    const int end = in.start_pos + int(in.tokens.size());
    const std::vector<int32_t>& table = kv_pool_->extend(in.seq_id, in.start_pos, end, in.tokens);
    BatchSegment seg;
    seg.begin = int(b.tokens.size());
    seg.count = int(in.tokens.size());
    seg.block_table = table.data();
    b.segments.push_back(seg);
    for (size_t j = 0; j < in.tokens.size(); ++j) {
      b.tokens.push_back(in.tokens[j]);
      b.positions.push_back(in.start_pos + int32_t(j));
    }
    if (in.sample) {
      logit_of[i] = b.logit_rows.size();
      b.logit_rows.push_back(int(b.tokens.size()) - 1);
    }
  }

  const int V = d.vocab_size;
  const size_t per_seq = size_t(d.n_moe_layers()) * d.moe.n_experts;
  std::vector<float> logits(b.logit_rows.size() * size_t(V));
  std::vector<uint16_t> counts(inputs.size() * per_seq, 0);
  pass_->run(b, logits.data(), counts.data(), nullptr);

  std::vector<SeqOutput> out(inputs.size());
  std::vector<float> adjusted;
  for (size_t i = 0; i < inputs.size(); ++i) {
    const SeqInput& in = inputs[i];
    SeqOutput& o = out[i];
    o.seq_id = in.seq_id;
    if (!skipped.empty()) o.cached_tokens = skipped[i];
    o.expert_counts.assign(counts.begin() + i * per_seq, counts.begin() + (i + 1) * per_seq);
    if (logit_of[i] == SIZE_MAX) continue;
    const float* row = logits.data() + logit_of[i] * V;
    // The draw is keyed by the position the new token will take.
    const int64_t pos = int64_t(in.start_pos) + int64_t(in.tokens.size());
    if (in.sampling.adjust.empty() && in.sampling.allowed.empty()) {
      o.token = cpu::sample_token(row, V, in.sampling, pos);
    } else {  // the draw sees the adjusted row; log probabilities stay the raw model's
      adjusted.assign(row, row + V);
      cpu::adjust_logits(adjusted.data(), V, in.sampling.adjust, in.sampling.penalties);
      if (!in.sampling.allowed.empty()) cpu::mask_logits(adjusted.data(), V, in.sampling.allowed.data());
      o.token = cpu::sample_token(adjusted.data(), V, in.sampling, pos);
    }
    if (in.sampling.logprobs || in.sampling.top_logprobs > 0)
      o.logprob = cpu::token_logprob(row, V, o.token);
    if (in.sampling.top_logprobs > 0) o.top = cpu::top_logprobs(row, V, in.sampling.top_logprobs);
    if (in.score_token >= 0 && in.score_token < V) o.score_logprob = cpu::token_logprob(row, V, in.score_token);
  }
  return out;
}

Result<std::vector<float>> CpuEngine::forward_logits(std::span<const int32_t> tokens,
                                                     ForwardTrace* trace) {
  const ModelDesc& d = desc();
  const int T = int(tokens.size());
  if (T == 0) return make_error("no tokens");
  if (T > max_context_)
    return make_error(std::to_string(T) + " tokens exceed the context of " +
                      std::to_string(max_context_));
  for (int32_t t : tokens)
    if (t < 0 || t >= d.vocab_size)
      return make_error("token id " + std::to_string(t) + " out of range");
  auto taken = kv_pool_->take(kv_pool_->blocks_for(T));
  if (!taken) return make_error("KV cache full");
  const std::vector<int32_t> blocks = std::move(*taken);
  Batch b;
  b.tokens.assign(tokens.begin(), tokens.end());
  for (int i = 0; i < T; ++i) {
    b.positions.push_back(i);
    b.logit_rows.push_back(i);
  }
  b.segments.push_back({0, T, blocks.data()});
  std::vector<float> logits(size_t(T) * d.vocab_size);
  pass_->run(b, logits.data(), nullptr, trace);
  kv_pool_->give_back(blocks);
  return logits;
}

}  // namespace moe
