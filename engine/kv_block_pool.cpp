#include "engine/kv_block_pool.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>

namespace moe {

KvBlockPool::KvBlockPool(int n_blocks, int block_tokens) : n_blocks_(n_blocks), block_tokens_(block_tokens) {
  free_.reserve(size_t(std::max(n_blocks, 0)));
  for (int b = n_blocks - 1; b >= 0; --b) free_.push_back(b);
}

int KvBlockPool::length(uint64_t seq) const {
  auto it = seqs_.find(seq);
  return it == seqs_.end() ? -1 : it->second.length;
}

int KvBlockPool::owned(uint64_t seq) const {
  auto it = seqs_.find(seq);
  return it == seqs_.end() ? 0 : int(it->second.blocks.size());
}

const std::vector<int32_t>& KvBlockPool::table(uint64_t seq) const {
  static const std::vector<int32_t> none;
  auto it = seqs_.find(seq);
  return it == seqs_.end() ? none : it->second.blocks;
}

const std::vector<int32_t>& KvBlockPool::extend(uint64_t seq, int start_pos, int end) {
  if (start_pos == 0) release(seq);
  Held& h = seqs_[seq];
  while (int(h.blocks.size()) < blocks_for(end)) {
    if (free_.empty()) {
      // An admitted step cannot run short; a caller that skipped the checks can.
      std::fprintf(stderr, "KvBlockPool: sequence %llu needs a block and none is free (inputs not checked)\n",
                   static_cast<unsigned long long>(seq));
      std::abort();
    }
    h.blocks.push_back(free_.back());
    free_.pop_back();
  }
  h.length = end;
  return h.blocks;
}

void KvBlockPool::release(uint64_t seq) {
  auto it = seqs_.find(seq);
  if (it == seqs_.end()) return;
  for (int32_t b : it->second.blocks) free_.push_back(b);
  seqs_.erase(it);
}

std::optional<std::vector<int32_t>> KvBlockPool::take(int n) {
  if (n > free()) return std::nullopt;
  std::vector<int32_t> out;
  for (int i = 0; i < n; ++i) {
    out.push_back(free_.back());
    free_.pop_back();
  }
  return out;
}

void KvBlockPool::give_back(std::span<const int32_t> blocks) {
  for (int32_t b : blocks) free_.push_back(b);
}

Admission StepAdmission::check(const SeqInput& in, int* net_blocks) {
  *net_blocks = 0;
  if (!seen_.insert(in.seq_id).second) return {Refusal::invalid_input, "appears twice in one step"};
  if (in.tokens.empty()) return {Refusal::invalid_input, "no tokens"};
  for (int32_t t : in.tokens)
    if (t < 0 || t >= vocab_) return {Refusal::invalid_input, "token id " + std::to_string(t) + " out of range"};
  for (const TokenAdjust& a : in.sampling.adjust)
    if (a.token < 0 || a.token >= vocab_)
      return {Refusal::invalid_input, "adjusted token id " + std::to_string(a.token) + " out of range"};
  if (!in.sampling.allowed.empty() && in.sampling.allowed.size() != size_t(vocab_ + 31) / 32)
    return {Refusal::invalid_input, "allowed has " + std::to_string(in.sampling.allowed.size()) +
                                        " words, the vocabulary needs " + std::to_string((vocab_ + 31) / 32)};
  const int have = pool_.length(in.seq_id);
  if (in.start_pos != 0 && in.start_pos != have)
    return {have < 0 ? Refusal::unknown_sequence : Refusal::invalid_input,
            "start_pos " + std::to_string(in.start_pos) + " but the sequence holds " + std::to_string(std::max(have, 0)) +
                " tokens"};
  const int64_t end = int64_t(in.start_pos) + int64_t(in.tokens.size());
  if (end > max_context_)
    return {Refusal::context_exceeded,
            std::to_string(end) + " tokens exceed the context of " + std::to_string(max_context_)};
  const int owned = pool_.owned(in.seq_id), need = pool_.blocks_for(int(end));
  *net_blocks = in.start_pos == 0 ? need - owned : std::max(0, need - owned);
  return {};
}

Admission StepAdmission::admit(const SeqInput& in) {
  int net = 0;
  Admission a = check(in, &net);
  if (!a.ok()) return a;
  if (net_blocks_ + net > pool_.free())
    return {Refusal::kv_full, "the KV cache has too few free blocks for this sequence (" +
                                  std::to_string(pool_.free() - net_blocks_) + " free, " + std::to_string(net) +
                                  " needed)"};
  net_blocks_ += net;
  return {};
}

Status check_step_inputs(std::span<const SeqInput> inputs, const KvBlockPool& pool, int vocab, int max_context) {
  StepAdmission adm(pool, vocab, max_context);
  int net = 0;
  for (const SeqInput& in : inputs) {
    int n = 0;
    const Admission a = adm.check(in, &n);
    if (!a.ok()) return make_error("sequence " + std::to_string(in.seq_id) + ": " + a.message);
    net += n;
  }
  if (net > pool.free())
    return make_error("KV cache full: the step needs " + std::to_string(net) + " more blocks, " +
                      std::to_string(pool.free()) + " free");
  return {};
}

}  // namespace moe
