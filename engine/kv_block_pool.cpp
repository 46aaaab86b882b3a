#include "engine/kv_block_pool.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <random>

namespace moe {

KvBlockPool::KvBlockPool(int n_blocks, int block_tokens) : n_blocks_(n_blocks), block_tokens_(block_tokens) {
  free_.reserve(size_t(std::max(n_blocks, 0)));
  for (int b = 0; b < n_blocks; ++b) free_.push_back(b);  // ascending: already a min-heap
  refs_.assign(size_t(std::max(n_blocks, 0)), 0);
  hash_.assign(size_t(std::max(n_blocks, 0)), 0);
  cached_at_.assign(size_t(std::max(n_blocks, 0)), cached_.end());
  // A salt per pool: which prompts share a hash cannot be worked out from outside.
  salt_ = std::random_device{}() * 0x9E3779B97F4A7C15ull ^ uint64_t(std::random_device{}()) << 32 | 1u;
}

static uint64_t mix(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

uint64_t KvBlockPool::block_hash(uint64_t chain, std::span<const int32_t> block) const {
  uint64_t h = mix(chain ^ salt_);
  for (int32_t t : block) h = mix(h ^ (uint64_t(uint32_t(t)) + 0x632BE59BD9B4E019ull));
  return h == 0 ? 1 : h;  // 0 means "no hash"
}

void KvBlockPool::put_free(int32_t b) {
  free_.push_back(b);
  std::push_heap(free_.begin(), free_.end(), std::greater<>());
}

int32_t KvBlockPool::take_block() {
  if (!free_.empty()) {
    // The lowest free id: the top of the id range stays free for the pool
    // to give back (shrink_free_tail).
    std::pop_heap(free_.begin(), free_.end(), std::greater<>());
    const int32_t b = free_.back();
    free_.pop_back();
    return b;
  }
  // The least recently released cached prefix block: forgotten, reused.
  const int32_t b = cached_.front();
  cached_.pop_front();
  cached_at_[size_t(b)] = cached_.end();
  by_hash_.erase(hash_[size_t(b)]);
  hash_[size_t(b)] = 0;
  return b;
}

void KvBlockPool::unref(int32_t b) {
  if (--refs_[size_t(b)] > 0) return;
  const uint64_t h = hash_[size_t(b)];
  auto it = h ? by_hash_.find(h) : by_hash_.end();
  if (it != by_hash_.end() && it->second == b) {
    cached_at_[size_t(b)] = cached_.insert(cached_.end(), b);
  } else {
    hash_[size_t(b)] = 0;
    put_free(b);
  }
}

void KvBlockPool::grow(int n) {
  if (n <= 0) return;
  // Higher than every id there: the lower ones already free keep going out first.
  for (int b = n_blocks_; b < n_blocks_ + n; ++b) put_free(b);
  n_blocks_ += n;
  refs_.resize(size_t(n_blocks_), 0);
  hash_.resize(size_t(n_blocks_), 0);
  cached_at_.resize(size_t(n_blocks_), cached_.end());
}

int KvBlockPool::shrink_free_tail(int target, int floor) {
  target = std::max({target, floor, 0});
  bool erased = false;
  while (n_blocks_ > target) {
    const int32_t top = int32_t(n_blocks_ - 1);
    if (refs_[size_t(top)] > 0) break;
    if (cached_at_[size_t(top)] != cached_.end()) {
      cached_.erase(cached_at_[size_t(top)]);
      by_hash_.erase(hash_[size_t(top)]);
    } else {
      auto it = std::find(free_.begin(), free_.end(), top);
      if (it == free_.end()) break;  // neither held nor free: taken outside a sequence (take)
      free_.erase(it);
      erased = true;
    }
    --n_blocks_;
    refs_.pop_back();
    hash_.pop_back();
    cached_at_.pop_back();
  }
  // The erasures broke the heap's order: rebuilt once, not per block.
  if (erased) std::make_heap(free_.begin(), free_.end(), std::greater<>());
  return n_blocks_;
}

int KvBlockPool::length(uint64_t seq) const {
  auto it = seqs_.find(seq);
  return it == seqs_.end() ? -1 : it->second.length;
}

int KvBlockPool::freed_by_release(uint64_t seq) const {
  auto it = seqs_.find(seq);
  if (it == seqs_.end()) return 0;
  int n = 0;
  for (int32_t b : it->second.blocks) n += refs_[size_t(b)] == 1;
  return n;
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
  return extend(seq, start_pos, end, {});
}

const std::vector<int32_t>& KvBlockPool::extend(uint64_t seq, int start_pos, int end, std::span<const int32_t> tokens) {
  if (start_pos == 0) release(seq);
  Held& h = seqs_[seq];
  if (start_pos == 0) h.hashing = !tokens.empty();
  if (tokens.size() != size_t(end - start_pos)) h.hashing = false;
  while (int(h.blocks.size()) < blocks_for(end)) {
    if (free() == 0) {
      // An admitted step cannot run short; a caller that skipped the checks can.
      std::fprintf(stderr, "KvBlockPool: sequence %llu needs a block and none is free (inputs not checked)\n",
                   static_cast<unsigned long long>(seq));
      std::abort();
    }
    const int32_t b = take_block();
    refs_[size_t(b)] = 1;
    h.blocks.push_back(b);
  }
  // Each block the tokens fill gets its prefix's hash, and is found by it
  // (the first block of a content keeps the name; a twin stays private).
  if (h.hashing) {
    for (size_t j = 0; j < tokens.size(); ++j) {
      h.partial.push_back(tokens[j]);
      if (int(h.partial.size()) < block_tokens_) continue;
      const size_t k = (size_t(start_pos) + j + 1) / size_t(block_tokens_) - 1;  // the block token j fills
      h.chain = block_hash(h.chain, h.partial);
      h.partial.clear();
      const int32_t b = h.blocks[k];
      if (hash_[size_t(b)] == 0 && !by_hash_.count(h.chain)) {
        hash_[size_t(b)] = h.chain;
        by_hash_[h.chain] = b;
      }
    }
  }
  h.length = end;
  return h.blocks;
}

void KvBlockPool::release(uint64_t seq) {
  auto it = seqs_.find(seq);
  if (it == seqs_.end()) return;
  for (int32_t b : it->second.blocks) unref(b);
  seqs_.erase(it);
}

int KvBlockPool::cached_blocks_after(uint64_t chain, std::span<const int32_t> tokens) const {
  int n = 0;
  while (size_t(n + 1) * size_t(block_tokens_) < tokens.size()) {  // the last token stays to compute
    chain = block_hash(chain, tokens.subspan(size_t(n) * size_t(block_tokens_), size_t(block_tokens_)));
    if (!by_hash_.count(chain)) break;
    ++n;
  }
  return n;
}

int KvBlockPool::cached_prefix_blocks(std::span<const int32_t> tokens) const { return cached_blocks_after(0, tokens); }

void KvBlockPool::attach_blocks(Held& h, std::span<const int32_t> tokens, int blocks) {
  for (int k = 0; k < blocks; ++k) {
    h.chain = block_hash(h.chain, tokens.subspan(size_t(k) * size_t(block_tokens_), size_t(block_tokens_)));
    const int32_t b = by_hash_.at(h.chain);
    if (refs_[size_t(b)]++ == 0 && cached_at_[size_t(b)] != cached_.end()) {
      cached_.erase(cached_at_[size_t(b)]);
      cached_at_[size_t(b)] = cached_.end();
    }
    h.blocks.push_back(b);
  }
  h.length += blocks * block_tokens_;
}

void KvBlockPool::attach_prefix(uint64_t seq, std::span<const int32_t> tokens, int blocks) {
  release(seq);
  Held& h = seqs_[seq];
  h.hashing = true;
  attach_blocks(h, tokens, blocks);
}

int KvBlockPool::reusable_blocks(const SeqInput& in) const {
  if (in.start_pos == 0) return cached_blocks_after(0, in.tokens);
  // The next chunk of a prompt whose blocks so far are whole and hashed
  // (a long prompt arrives in several chunks).
  auto it = seqs_.find(in.seq_id);
  if (it == seqs_.end() || !it->second.hashing || !it->second.partial.empty() || it->second.length != in.start_pos ||
      in.start_pos % block_tokens_ != 0)
    return 0;
  return cached_blocks_after(it->second.chain, in.tokens);
}

std::span<const SeqInput> KvBlockPool::reuse_prefixes(std::span<const SeqInput> inputs, std::vector<SeqInput>* rewritten,
                                                      std::vector<int>* skipped) {
  skipped->clear();
  std::vector<int> blocks(inputs.size(), 0);
  bool any = false;
  for (size_t i = 0; i < inputs.size(); ++i) any = (blocks[i] = reusable_blocks(inputs[i])) > 0 || any;
  if (!any) return inputs;  // nothing cached: the step runs as given, nothing copied
  rewritten->assign(inputs.begin(), inputs.end());
  skipped->assign(inputs.size(), 0);
  for (size_t i = 0; i < inputs.size(); ++i) {
    if (blocks[i] == 0) continue;
    SeqInput& in = (*rewritten)[i];
    if (in.start_pos == 0)
      attach_prefix(in.seq_id, in.tokens, blocks[i]);
    else
      attach_blocks(seqs_.at(in.seq_id), in.tokens, blocks[i]);
    const int n = blocks[i] * block_tokens_;
    in.tokens.erase(in.tokens.begin(), in.tokens.begin() + n);
    in.start_pos += n;
    (*skipped)[i] = n;
    reused_tokens_ += uint64_t(n);
  }
  return *rewritten;
}

std::optional<std::vector<int32_t>> KvBlockPool::take(int n) {
  if (n > free()) return std::nullopt;
  std::vector<int32_t> out;
  for (int i = 0; i < n; ++i) out.push_back(take_block());
  return out;
}

void KvBlockPool::give_back(std::span<const int32_t> blocks) {
  for (int32_t b : blocks) put_free(b);
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
  // A restart gives back only the blocks no other sequence shares.
  *net_blocks = in.start_pos == 0 ? need - pool_.freed_by_release(in.seq_id) : std::max(0, need - owned);
  return {};
}

Admission StepAdmission::admit(const SeqInput& in) {
  int net = 0;
  Admission a = check(in, &net);
  if (!a.ok()) return a;
  if (net_blocks_ + net > pool_.free() + headroom_)
    return {Refusal::kv_full, "the KV cache has too few free blocks for this sequence (" +
                                  std::to_string(pool_.free() + headroom_ - net_blocks_) + " free, " + std::to_string(net) +
                                  " needed)"};
  net_blocks_ += net;
  return {};
}

Status check_step_inputs(std::span<const SeqInput> inputs, const KvBlockPool& pool, int vocab, int max_context,
                         int headroom, int* net_blocks) {
  StepAdmission adm(pool, vocab, max_context, headroom);
  int net = 0;
  for (const SeqInput& in : inputs) {
    int n = 0;
    const Admission a = adm.check(in, &n);
    if (!a.ok()) return make_error("sequence " + std::to_string(in.seq_id) + ": " + a.message);
    net += n;
  }
  if (net_blocks) *net_blocks = net;
  if (net > pool.free() + headroom)
    return make_error("KV cache full: the step needs " + std::to_string(net) + " more blocks, " +
                      std::to_string(pool.free() + headroom) + " free");
  return {};
}

void KvBlockPool::release_restarts(std::span<const SeqInput> inputs) {
  for (const SeqInput& in : inputs)
    if (in.start_pos == 0) release(in.seq_id);
}

}  // namespace moe
