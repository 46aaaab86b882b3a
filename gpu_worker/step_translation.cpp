#include "gpu_worker/step_translation.h"

#include <algorithm>
#include <string>
#include <unordered_set>

namespace moe::worker {

using protocol::ErrorCode;

TranslatedStep translate_step(const protocol::StepRequest& req, const EngineLimits& lim) {
  TranslatedStep t;
  t.reply.results.resize(req.sequences.size());
  std::unordered_set<uint64_t> seen;
  int need_blocks = 0;
  const int bt = lim.kv_block_tokens;
  for (size_t i = 0; i < req.sequences.size(); ++i) {
    const protocol::StepSequence& s = req.sequences[i];
    protocol::StepResult& r = t.reply.results[i];
    r.seq_id = s.seq_id;
    auto fail = [&](ErrorCode code, std::string msg) {
      r.error = code;
      r.error_message = std::move(msg);
    };
    if (s.seq_id == 0) { fail(ErrorCode::invalid_argument, "sequence id 0 is reserved"); continue; }
    if (!seen.insert(s.seq_id).second) { fail(ErrorCode::invalid_argument, "sequence appears twice in the step"); continue; }
    if (s.tokens.empty()) { fail(ErrorCode::invalid_argument, "no tokens"); continue; }
    if (std::any_of(s.tokens.begin(), s.tokens.end(), [&](int32_t tok) { return tok < 0 || tok >= lim.vocab; })) {
      fail(ErrorCode::invalid_argument, "token id out of range");
      continue;
    }
    const int have = lim.seq_length(s.seq_id);
    if (s.start_pos != 0 && int64_t(s.start_pos) != have) {
      fail(have < 0 ? ErrorCode::unknown_sequence : ErrorCode::invalid_argument,
           "start_pos " + std::to_string(s.start_pos) + " but the worker holds " + std::to_string(std::max(have, 0)) +
               " tokens");
      continue;
    }
    const int64_t end = int64_t(s.start_pos) + int64_t(s.tokens.size());
    if (end > lim.max_context) {
      fail(ErrorCode::limit_exceeded,
           std::to_string(end) + " tokens exceed the context of " + std::to_string(lim.max_context));
      continue;
    }
    const int held = s.start_pos == 0 ? 0 : (std::max(have, 0) + bt - 1) / bt;
    const int extra = int((end + bt - 1) / bt) - held;
    const int freed = s.start_pos == 0 && have > 0 ? (have + bt - 1) / bt : 0;
    if (need_blocks + extra > lim.kv_blocks_free + freed) {
      fail(ErrorCode::out_of_kv_blocks, "the KV cache has too few free blocks for this sequence");
      continue;
    }
    need_blocks += extra - freed;
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
    t.inputs.push_back(std::move(in));
    t.result_of.push_back(i);
  }
  return t;
}

void fill_step_results(TranslatedStep& t, const Result<std::vector<SeqOutput>>& out, bool report_expert_usage,
                       const std::function<int(uint64_t)>& seq_length) {
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
    r.logprob = o.logprob;
    for (const auto& [tok, lp] : o.top) r.top.push_back({tok, lp});
    if (report_expert_usage) r.expert_usage = o.expert_counts;
  }
  for (auto& r : t.reply.results) r.kv_tokens = uint32_t(std::max(seq_length(r.seq_id), 0));
}

}  // namespace moe::worker
