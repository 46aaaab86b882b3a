#include "worker/step_translation.h"

#include <algorithm>
#include <chrono>
#include <span>

#include "worker/model_hello.h"

namespace moe::worker {

using protocol::ErrorCode;

namespace {

ErrorCode error_of(Refusal r) {
  switch (r) {
    case Refusal::unknown_sequence: return ErrorCode::unknown_sequence;
    case Refusal::context_exceeded: return ErrorCode::limit_exceeded;
    case Refusal::kv_full: return ErrorCode::out_of_kv_blocks;
    case Refusal::invalid_input:
    case Refusal::none: break;
  }
  return ErrorCode::invalid_argument;
}

SeqInput input_of(const protocol::StepSequence& s) {
  SeqInput in;
  in.seq_id = s.seq_id;
  in.tokens = s.tokens;
  in.start_pos = int32_t(s.start_pos);
  in.sample = s.sample;
  in.sampling.temperature = s.sampling.temperature;
  in.sampling.top_p = s.sampling.top_p;
  in.sampling.top_k = int(s.sampling.top_k);
  in.sampling.seed = s.sampling.seed;
  in.sampling.logprobs = s.sampling.logprobs;
  in.sampling.top_logprobs = s.sampling.top_logprobs;
  in.sampling.min_p = s.sampling.min_p;
  in.sampling.penalties = {s.sampling.repetition_penalty, s.sampling.presence_penalty, s.sampling.frequency_penalty};
  in.sampling.adjust = s.sampling.adjust;
  in.sampling.allowed = s.sampling.allowed;
  return in;
}

}  // namespace

TranslatedStep translate_step(const protocol::StepRequest& req, const Engine& engine) {
  TranslatedStep t;
  t.reply.results.resize(req.sequences.size());
  StepAdmission admission = engine.admission();
  for (size_t i = 0; i < req.sequences.size(); ++i) {
    const protocol::StepSequence& s = req.sequences[i];
    protocol::StepResult& r = t.reply.results[i];
    r.seq_id = s.seq_id;
    if (s.seq_id == 0) {
      r.error = ErrorCode::invalid_argument;
      r.error_message = "sequence id 0 is reserved";
      continue;
    }
    SeqInput in = input_of(s);
    // A mask as long as the tokenizer's vocabulary covers a model whose
    // embedding is padded past it: the ids beyond are never allowed.
    if (const size_t words = size_t(engine.desc().vocab_size + 31) / 32;
        !in.sampling.allowed.empty() && in.sampling.allowed.size() < words)
      in.sampling.allowed.resize(words, 0u);
    if (const Admission a = admission.admit(in); !a.ok()) {
      r.error = error_of(a.refusal);
      r.error_message = a.message;
      continue;
    }
    t.inputs.push_back(std::move(in));
    t.result_of.push_back(i);
  }
  return t;
}

void fill_step_results(TranslatedStep& t, const Result<std::vector<SeqOutput>>& out, bool report_expert_usage,
                       const Engine& engine) {
  for (size_t k = 0; k < t.inputs.size(); ++k) {
    protocol::StepResult& r = t.reply.results[t.result_of[k]];
    if (!out.ok()) {
      r.error = ErrorCode::internal;
      r.error_message = out.error();
      continue;
    }
    const SeqOutput& o = (*out)[k];
    r.sampled = o.token >= 0;
    r.token = std::max(o.token, 0);
    r.cached_tokens = uint32_t(std::max(o.cached_tokens, 0));
    r.logprob = o.logprob;
    for (const auto& [tok, lp] : o.top) r.top.push_back({tok, lp});
    if (report_expert_usage) r.expert_usage = o.expert_counts;
  }
  for (auto& r : t.reply.results) r.kv_tokens = uint32_t(std::max(engine.seq_length(r.seq_id), 0));
}

protocol::Hello engine_hello(const Engine& e, const std::string& model_id, const char* backend) {
  protocol::Hello h = model_hello(e.desc());
  h.model_id = model_id;
  h.backend = backend;
  h.instance = "moe-worker";
  h.kv_blocks_total = uint32_t(e.kv_blocks_reachable());  // the gateway plans against what the worker can reach
  h.kv_block_tokens = uint32_t(e.kv_block_tokens());
  h.max_context = uint32_t(e.max_context());
  return h;
}

protocol::StepReply run_engine_step(Engine& e, const protocol::StepRequest& req,
                                    const std::function<void(const Result<std::vector<SeqOutput>>&)>& on_outputs) {
  using Clock = std::chrono::steady_clock;
  const auto t0 = Clock::now();
  TranslatedStep t = translate_step(req, e);
  const auto t1 = Clock::now();
  if (!t.inputs.empty()) {
    auto out = e.step(std::span<const SeqInput>(t.inputs));
    on_outputs(out);
    fill_step_results(t, out, req.report_expert_usage, e);
  } else {
    fill_step_results(t, std::vector<SeqOutput>{}, req.report_expert_usage, e);
  }
  const auto t2 = Clock::now();
  protocol::StepReply& reply = t.reply;
  reply.timing.compute_us = uint32_t(std::chrono::duration_cast<std::chrono::microseconds>(t2 - t1).count());
  reply.timing.total_us = uint32_t(std::chrono::duration_cast<std::chrono::microseconds>(t2 - t0).count());
  reply.kv_blocks_free = uint32_t(e.kv_blocks_available());
  reply.kv_blocks_used = uint32_t(e.kv_blocks_total() - e.kv_blocks_free());
  return std::move(reply);
}

}  // namespace moe::worker
