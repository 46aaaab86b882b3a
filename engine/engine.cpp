#include "engine/engine.h"

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
    const size_t per_block = KvCache::block_bytes(d.n_layers, opts.kv_block_tokens, nkv, qk, vd);
    blocks = int(std::min<size_t>(opts.kv_bytes_budget / per_block, size_t(1) << 30));
  }
  if (blocks < 1) return make_error("the KV budget holds no block");
  e->kv_ = std::make_unique<KvCache>(d.n_layers, blocks, opts.kv_block_tokens, nkv, qk, vd);
  e->max_context_ = d.max_position > 0 ? d.max_position : blocks * opts.kv_block_tokens;
  e->pass_ = std::make_unique<ForwardPass>(e->files_->desc(), *e->weights_, *e->kv_, *e->pool_);
  return e;
}

int CpuEngine::seq_length(uint64_t seq_id) const {
  auto it = seqs_.find(seq_id);
  return it == seqs_.end() ? -1 : it->second.length;
}

void CpuEngine::set_progress(std::atomic<uint64_t>* progress) { pass_->set_progress(progress); }

void CpuEngine::release(uint64_t seq_id) {
  auto it = seqs_.find(seq_id);
  if (it == seqs_.end()) return;
  for (int32_t b : it->second.blocks) kv_->release(b);
  seqs_.erase(it);
}

Status check_step_inputs(std::span<const SeqInput> inputs, int vocab, int max_context, int block_tokens,
                         int free_blocks, const std::function<std::optional<HeldSequence>(uint64_t)>& held) {
  auto blocks_for = [block_tokens](int tokens) { return (tokens + block_tokens - 1) / block_tokens; };
  std::unordered_set<uint64_t> ids;
  int need = 0, freed = 0;
  for (const SeqInput& in : inputs) {
    const std::string who = "sequence " + std::to_string(in.seq_id);
    if (!ids.insert(in.seq_id).second) return make_error(who + " appears twice in one step");
    if (in.tokens.empty()) return make_error(who + ": no tokens");
    for (int32_t t : in.tokens)
      if (t < 0 || t >= vocab) return make_error(who + ": token id " + std::to_string(t) + " out of range");
    const std::optional<HeldSequence> h = held(in.seq_id);
    const int have = h ? h->length : 0;
    if (in.start_pos != 0 && in.start_pos != have)
      return make_error(who + ": start_pos " + std::to_string(in.start_pos) + " but the sequence holds " +
                        std::to_string(have) + " tokens");
    const int end = in.start_pos + int(in.tokens.size());
    if (end > max_context)
      return make_error(who + ": " + std::to_string(end) + " tokens exceed the context of " +
                        std::to_string(max_context));
    const int owned = h ? h->blocks : 0;
    if (in.start_pos == 0) {
      freed += owned;
      need += blocks_for(end);
    } else {
      need += std::max(0, blocks_for(end) - owned);
    }
  }
  if (need > free_blocks + freed)
    return make_error("KV cache full: the step needs " + std::to_string(need) + " blocks, " +
                      std::to_string(free_blocks + freed) + " free");
  return {};
}

Result<std::vector<SeqOutput>> CpuEngine::step(std::span<const SeqInput> inputs) {
  const ModelDesc& d = desc();
  // Validate everything before touching any state.
  const Status checked = check_step_inputs(inputs, d.vocab_size, max_context_, kv_->block_tokens(), kv_->blocks_free(),
                                           [this](uint64_t id) -> std::optional<HeldSequence> {
                                             auto it = seqs_.find(id);
                                             if (it == seqs_.end()) return std::nullopt;
                                             return HeldSequence{it->second.length, int(it->second.blocks.size())};
                                           });
  if (!checked.ok()) return make_error(checked.error());

  Batch b;
  std::vector<size_t> logit_of(inputs.size(), SIZE_MAX);
  for (size_t i = 0; i < inputs.size(); ++i) {
    const SeqInput& in = inputs[i];
    if (in.start_pos == 0) release(in.seq_id);
    Sequence& s = seqs_[in.seq_id];
    const int end = in.start_pos + int(in.tokens.size());
    while (int(s.blocks.size()) < blocks_for(end)) s.blocks.push_back(kv_->allocate());
    BatchSegment seg;
    seg.begin = int(b.tokens.size());
    seg.count = int(in.tokens.size());
    seg.block_table = s.blocks.data();
    b.segments.push_back(seg);
    for (size_t j = 0; j < in.tokens.size(); ++j) {
      b.tokens.push_back(in.tokens[j]);
      b.positions.push_back(in.start_pos + int32_t(j));
    }
    s.length = end;
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
  for (size_t i = 0; i < inputs.size(); ++i) {
    const SeqInput& in = inputs[i];
    SeqOutput& o = out[i];
    o.seq_id = in.seq_id;
    o.expert_counts.assign(counts.begin() + i * per_seq, counts.begin() + (i + 1) * per_seq);
    if (logit_of[i] == SIZE_MAX) continue;
    const float* row = logits.data() + logit_of[i] * V;
    const cpu::SampleParams sp{in.sampling.temperature, in.sampling.top_p, in.sampling.top_k,
                               in.sampling.seed};
    // The draw is keyed by the position the new token will take.
    const int64_t pos = int64_t(in.start_pos) + int64_t(in.tokens.size());
    o.token = cpu::sample_token(row, V, sp, pos);
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
  if (blocks_for(T) > kv_->blocks_free()) return make_error("KV cache full");

  std::vector<int32_t> blocks;
  for (int i = 0; i < blocks_for(T); ++i) blocks.push_back(kv_->allocate());
  Batch b;
  b.tokens.assign(tokens.begin(), tokens.end());
  for (int i = 0; i < T; ++i) {
    b.positions.push_back(i);
    b.logit_rows.push_back(i);
  }
  b.segments.push_back({0, T, blocks.data()});
  std::vector<float> logits(size_t(T) * d.vocab_size);
  pass_->run(b, logits.data(), nullptr, trace);
  for (int32_t blk : blocks) kv_->release(blk);
  return logits;
}

}  // namespace moe
