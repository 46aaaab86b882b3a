#include "gateway/sched/token_controls.h"

#include <algorithm>
#include <limits>

namespace moe::gw {

bool penalties_on(const Sampling& s) {
  return s.repetition_penalty != 1.0f || s.presence_penalty != 0.0f || s.frequency_penalty != 0.0f;
}

TokenAdjust& TokenControls::at(int32_t token) {
  auto it = std::lower_bound(list_.begin(), list_.end(), token,
                             [](const TokenAdjust& a, int32_t t) { return a.token < t; });
  if (it == list_.end() || it->token != token) it = list_.insert(it, TokenAdjust{token, 0.0f, 0, 0});
  return *it;
}

TokenControls::TokenControls(const SequenceRequest& req, std::span<const int32_t> generated)
    : track_(penalties_on(req.sampling)), grammar_(req.grammar) {
  for (const auto& [token, bias] : req.logit_bias) at(token).bias = bias;
  if (track_)
    for (int32_t t : req.prompt) at(t).in_prompt = 1;
  if (grammar_) state_ = grammar_->start();
  for (int32_t t : generated) this->generated(t);
}

void TokenControls::generated(int32_t token) {
  if (grammar_ && !state_.empty()) {
    const std::string& bytes = grammar_->vocabulary().bytes(token);
    // A stop id (no bytes) ends the choice; anything else the mask allowed.
    if (bytes.empty() || !state_.feed(grammar_->schema(), bytes)) state_ = structured::GrammarState();
  }
  if (!track_) return;
  TokenAdjust& a = at(token);
  if (a.output_count < std::numeric_limits<uint16_t>::max()) ++a.output_count;
}

std::vector<uint32_t> TokenControls::allowed(const SequenceRequest& req) const {
  if (!grammar_ || state_.empty()) return {};
  std::vector<uint32_t> words = *grammar_->mask(state_);
  // The stop ids end the choice: allowed exactly when the value is complete.
  // A request's own stop ids may be text the grammar takes mid-value (a
  // newline, a brace): there they are cleared, or the choice would end
  // with the value open.
  const bool finishable = state_.finishable(grammar_->schema());
  for (int32_t id : req.stop_ids) {
    if (id < 0 || size_t(id) / 32 >= words.size()) continue;
    const uint32_t bit = 1u << (id % 32);
    if (finishable)
      words[size_t(id) / 32] |= bit;
    else
      words[size_t(id) / 32] &= ~bit;
  }
  return words;
}

std::vector<TokenAdjust> TokenControls::next(const SequenceRequest& req, int generated_count) const {
  std::vector<TokenAdjust> out = list_;
  if (generated_count >= req.min_tokens) return out;
  // Too early to end: the ids that would end the choice are banned.
  constexpr float kBanned = -std::numeric_limits<float>::infinity();
  for (int32_t id : req.stop_ids) {
    auto it = std::lower_bound(out.begin(), out.end(), id, [](const TokenAdjust& a, int32_t t) { return a.token < t; });
    if (it != out.end() && it->token == id)
      it->bias = kBanned;
    else
      out.insert(it, TokenAdjust{id, kBanned, 0, 0});
  }
  return out;
}

}  // namespace moe::gw
