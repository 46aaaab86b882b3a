// The KV block bookkeeping both engines share, and the admission of a
// step's inputs against it (the worker refuses each input it cannot run).
#include <catch2/catch.hpp>

#include "engine/kv_block_pool.h"

using namespace moe;

namespace {

SeqInput input(uint64_t id, int n_tokens, int start_pos) {
  SeqInput in;
  in.seq_id = id;
  in.tokens.assign(size_t(n_tokens), 1);
  in.start_pos = start_pos;
  return in;
}

}  // namespace

TEST_CASE("KvBlockPool hands out the lowest free ids first", "[kv]") {
  KvBlockPool pool(6, 4);
  CHECK(pool.total() == 6);
  CHECK(pool.free() == 6);
  CHECK(pool.blocks_for(0) == 0);
  CHECK(pool.blocks_for(4) == 1);
  CHECK(pool.blocks_for(5) == 2);
  CHECK(pool.length(7) == -1);
  CHECK(pool.owned(7) == 0);
  CHECK(pool.table(7).empty());

  CHECK(pool.extend(7, 0, 5) == std::vector<int32_t>{0, 1});
  CHECK(pool.length(7) == 5);
  CHECK(pool.extend(8, 0, 3) == std::vector<int32_t>{2});
  CHECK(pool.extend(7, 5, 9) == std::vector<int32_t>{0, 1, 3});  // grows in place
  CHECK(pool.free() == 2);
  pool.release(7);
  CHECK(pool.length(7) == -1);
  CHECK(pool.free() == 5);
  // Freed 0, 1, 3: the lowest comes back first.
  CHECK(pool.extend(9, 0, 1) == std::vector<int32_t>{0});
  // A restart at 0 gives back what the sequence held before taking again.
  CHECK(pool.extend(8, 0, 8) == std::vector<int32_t>{1, 2});
  auto t = pool.take(3);
  REQUIRE(t.has_value());
  CHECK(t->size() == 3);
  CHECK_FALSE(pool.take(1).has_value());
  pool.give_back(*t);
  CHECK(pool.free() == 3);
  pool.release(12345);  // unknown: ignored
}

TEST_CASE("StepAdmission refuses each input for its own reason and counts the admitted ones' blocks", "[kv]") {
  KvBlockPool pool(4, 4);
  pool.extend(1, 0, 6);  // 2 blocks, 6 tokens
  StepAdmission adm(pool, /*vocab=*/10, /*max_context=*/20);
  CHECK(adm.admit(input(1, 1, 6)).ok());  // 7 tokens: still 2 blocks
  CHECK(adm.admit(input(1, 1, 7)).refusal == Refusal::invalid_input);  // twice in one step
  CHECK(adm.admit(input(2, 0, 0)).refusal == Refusal::invalid_input);  // no tokens
  SeqInput bad = input(3, 2, 0);
  bad.tokens[1] = 10;
  CHECK(adm.admit(bad).refusal == Refusal::invalid_input);  // out of the vocabulary
  CHECK(adm.admit(input(4, 1, 3)).refusal == Refusal::unknown_sequence);
  CHECK(adm.admit(input(5, 21, 0)).refusal == Refusal::context_exceeded);
  CHECK(adm.admit(input(6, 8, 0)).ok());  // the 2 free blocks
  const Admission full = adm.admit(input(7, 1, 0));
  CHECK(full.refusal == Refusal::kv_full);
  CHECK(full.message.find("too few free blocks") != std::string::npos);
}

TEST_CASE("check_step_inputs judges the step as a whole: a restart's blocks count for the others", "[kv]") {
  KvBlockPool pool(3, 4);
  pool.extend(1, 0, 12);  // all 3 blocks
  // Sequence 2 needs a block only sequence 1's restart (1 block) gives back.
  std::vector<SeqInput> step = {input(2, 4, 0), input(1, 4, 0)};
  CHECK(check_step_inputs(step, pool, 10, 64).ok());
  step.push_back(input(3, 5, 0));
  const Status s = check_step_inputs(step, pool, 10, 64);
  REQUIRE_FALSE(s.ok());
  CHECK(s.error().find("KV cache full") != std::string::npos);
  const Status dup = check_step_inputs(std::vector<SeqInput>{input(2, 1, 0), input(2, 1, 0)}, pool, 10, 64);
  REQUIRE_FALSE(dup.ok());
  CHECK(dup.error().find("sequence 2") != std::string::npos);
  // Nothing changed.
  CHECK(pool.free() == 0);
  CHECK(pool.length(1) == 12);
}

TEST_CASE("prefix cache: released whole blocks are found by their prefix, shared, and evicted oldest first",
          "[kv][prefix]") {
  KvBlockPool pool(6, 4);
  const std::vector<int32_t> p = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10};  // two whole blocks and two tokens
  pool.extend(1, 0, 10, p);
  CHECK(pool.cached_prefix_blocks(p) == 2);  // found while its writer still holds them
  std::vector<int32_t> other = p;
  other[5] = 99;  // the second block differs
  CHECK(pool.cached_prefix_blocks(other) == 1);
  other[0] = 42;  // the chain starts differently: nothing
  CHECK(pool.cached_prefix_blocks(other) == 0);
  // A prompt of exactly the cached blocks leaves its last token to compute.
  CHECK(pool.cached_prefix_blocks(std::vector<int32_t>(p.begin(), p.begin() + 8)) == 1);

  pool.release(1);
  CHECK(pool.free() == 6);  // cached blocks still count as takeable
  CHECK(pool.cached_prefix_blocks(p) == 2);

  // Two sequences share the cached blocks; their own tokens go to new blocks.
  pool.attach_prefix(2, p, 2);
  pool.attach_prefix(3, p, 2);
  CHECK(pool.length(2) == 8);
  CHECK(pool.table(2) == pool.table(3));
  const std::vector<int32_t> shared = pool.table(2);
  pool.extend(2, 8, 10, std::vector<int32_t>{9, 10});
  pool.extend(3, 8, 11, std::vector<int32_t>{9, 10, 77});
  CHECK(pool.table(2)[2] != pool.table(3)[2]);
  CHECK(pool.free() == 2);
  pool.release(2);
  CHECK(pool.free() == 3);  // the shared blocks stay with sequence 3
  pool.release(3);
  CHECK(pool.free() == 6);

  // Under pressure the cached blocks are taken, the least recently released first.
  pool.extend(4, 0, 24, std::vector<int32_t>(24, 5));  // all six blocks
  CHECK(pool.cached_prefix_blocks(p) == 0);
  CHECK(pool.free() == 0);
  pool.release(4);

  // The rewrite of a step's fresh inputs: only the rest is computed.
  pool.extend(5, 0, 10, p);
  pool.release(5);
  std::vector<SeqInput> step(2);
  step[0].seq_id = 6;
  step[0].tokens = p;
  step[1].seq_id = 7;
  step[1].tokens = {8, 8, 8};
  std::vector<int> skipped;
  std::vector<SeqInput> rewritten;
  const auto ran = pool.reuse_prefixes(step, &rewritten, &skipped);
  CHECK(skipped == std::vector<int>{8, 0});
  REQUIRE(ran.size() == 2);
  CHECK(ran[0].start_pos == 8);
  CHECK(ran[0].tokens == std::vector<int32_t>{9, 10});
  CHECK(ran[1].start_pos == 0);
  CHECK(step[0].start_pos == 0);  // the caller's inputs stay as they were
  CHECK(pool.length(6) == 8);
  CHECK(pool.prefix_tokens_reused() == 8);
  // Nothing cached for any input: the inputs come back as given, nothing copied.
  std::vector<SeqInput> uncached(1);
  uncached[0].seq_id = 8;
  uncached[0].tokens = {5, 5, 5, 5, 5};
  const auto same = pool.reuse_prefixes(uncached, &rewritten, &skipped);
  CHECK(same.data() == uncached.data());
  CHECK(skipped.empty());
  // Extends without tokens (a caller that does not hash) cache nothing.
  KvBlockPool plain(4, 4);
  plain.extend(1, 0, 8);
  plain.release(1);
  CHECK(plain.cached_prefix_blocks(std::vector<int32_t>(9, 1)) == 0);
}

TEST_CASE("KvBlockPool grows without moving a sequence and shrinks only its free tail", "[kv][kv_pool]") {
  KvBlockPool pool(4, 16);
  std::vector<int32_t> toks(40);
  for (size_t i = 0; i < toks.size(); ++i) toks[i] = int32_t(i + 3);
  const auto a = pool.extend(1, 0, 40, toks);  // blocks 0 1 2 (two whole, hashed)
  REQUIRE(a == std::vector<int32_t>{0, 1, 2});
  pool.grow(3);
  CHECK(pool.total() == 7);
  CHECK(pool.free() == 4);
  CHECK(pool.table(1) == a);
  // The free block already there goes first, then the new ones lowest first.
  CHECK(pool.extend(2, 0, 64) == std::vector<int32_t>{3, 4, 5, 6});
  CHECK(pool.free() == 0);
  // Nothing free at the top: nothing given back.
  CHECK(pool.shrink_free_tail(4, 4) == 7);
  pool.release(2);
  CHECK(pool.shrink_free_tail(5, 4) == 5);
  CHECK(pool.free() == 2);
  // Sequence 1's released whole blocks stay cached prefixes; the floor holds.
  pool.release(1);
  CHECK(pool.cached_prefix_blocks(toks) == 2);
  CHECK(pool.shrink_free_tail(0, 2) == 2);
  CHECK(pool.total() == 2);
  CHECK(pool.free() == 2);
  // The blocks left are 0 and 1, the cached prefix among them, still found.
  CHECK(pool.cached_prefix_blocks(toks) == 2);
  // A shrink stops at the first block a sequence holds.
  pool.grow(2);
  CHECK(pool.extend(3, 0, 16) == std::vector<int32_t>{2});
  CHECK(pool.shrink_free_tail(0, 0) == 3);  // block 3 goes, 2 is held
  CHECK(pool.free() == 2);  // 0 and 1 (cached): taken when needed
  CHECK(pool.extend(4, 0, 32).size() == 2);
  CHECK(pool.free() == 0);
}

TEST_CASE("Admission counts the blocks an engine can still take from its islands as free", "[kv][kv_pool]") {
  KvBlockPool pool(4, 4);  // 16 tokens now
  // 24 tokens need 6 blocks: refused on the pool alone, admitted with 2 growable.
  {
    StepAdmission fixed(pool, 10, 64);
    CHECK(fixed.admit(input(1, 24, 0)).refusal == Refusal::kv_full);
    StepAdmission grows(pool, 10, 64, /*headroom=*/2);
    CHECK(grows.admit(input(1, 24, 0)).ok());
    CHECK(grows.admit(input(2, 1, 0)).refusal == Refusal::kv_full);  // the headroom is spent
  }
  const std::vector<SeqInput> step{input(1, 20, 0), input(2, 4, 0)};
  int net = -1;
  CHECK_FALSE(check_step_inputs(step, pool, 10, 64, 1, &net).ok());
  const Status s = check_step_inputs(step, pool, 10, 64, 2, &net);
  CHECK(s.ok());
  CHECK(net == 6);  // what the engine must grow by before extending: net - free
  pool.grow(net - pool.free());
  for (const SeqInput& in : step) pool.extend(in.seq_id, 0, int(in.tokens.size()), in.tokens);
  CHECK(pool.free() == 0);
  CHECK(pool.total() == 6);
}

TEST_CASE("A restart's blocks count for a new sequence before it: released first, the step runs",
          "[kv][kv_pool]") {
  KvBlockPool pool(5, 4);
  pool.extend(2, 0, 20);  // 5 blocks: the pool is full
  // A new sequence first (+1), then sequence 2 restarting with 4 tokens (-4).
  const std::vector<SeqInput> step{input(1, 4, 0), input(2, 4, 0)};
  int net = 0;
  REQUIRE(check_step_inputs(step, pool, 10, 64, 0, &net).ok());
  CHECK(net == -3);
  pool.release_restarts(step);
  CHECK(pool.free() == 5);
  for (const SeqInput& in : step) pool.extend(in.seq_id, 0, int(in.tokens.size()), in.tokens);  // no abort
  CHECK(pool.owned(1) == 1);
  CHECK(pool.owned(2) == 1);
  // The worker's admission, input by input, refuses the new one instead (it
  // cannot know yet that a later input gives back): conservative, not a crash.
  KvBlockPool full(5, 4);
  full.extend(2, 0, 20);
  StepAdmission adm(full, 10, 64);
  CHECK(adm.admit(input(1, 4, 0)).refusal == Refusal::kv_full);
  CHECK(adm.admit(input(2, 4, 0)).ok());
}

TEST_CASE("KvBlockPool's grown top empties once its sequences end, whatever ran meanwhile", "[kv][kv_pool]") {
  KvBlockPool pool(4, 4);
  pool.grow(100);
  pool.extend(1, 0, 4 * 90);  // a long prompt: blocks 0 … 89
  pool.release(1);
  // Short chats while it was held and after: they take the lowest ids.
  pool.extend(2, 0, 8);
  pool.extend(3, 0, 8);
  CHECK(pool.table(2) == std::vector<int32_t>{0, 1});
  CHECK(pool.table(3) == std::vector<int32_t>{2, 3});
  CHECK(pool.shrink_free_tail(8, 4) == 8);
  CHECK(pool.free() == 4);
}

TEST_CASE("A restart is credited only the blocks it does not share with another sequence", "[kv][kv_pool][prefix]") {
  KvBlockPool pool(4, 4);
  const std::vector<int32_t> prompt = {1, 2, 3, 4, 5, 6, 7, 8};
  pool.extend(1, 0, 8, prompt);  // 2 whole blocks, hashed
  pool.release(1);               // cached
  std::vector<SeqInput> again{input(2, 8, 0)};
  again[0].tokens = prompt;
  std::vector<SeqInput> rewritten;
  std::vector<int> skipped;
  auto in = pool.reuse_prefixes(again, &rewritten, &skipped);
  for (const SeqInput& s : in) pool.extend(s.seq_id, s.start_pos, s.start_pos + int(s.tokens.size()), s.tokens);
  REQUIRE(pool.owned(2) == 2);
  std::vector<SeqInput> third{input(3, 8, 0)};
  third[0].tokens = prompt;
  in = pool.reuse_prefixes(third, &rewritten, &skipped);
  for (const SeqInput& s : in) pool.extend(s.seq_id, s.start_pos, s.start_pos + int(s.tokens.size()), s.tokens);
  REQUIRE(pool.owned(3) == 2);  // its first block shared with sequence 2 (the last is computed again)
  CHECK(pool.freed_by_release(3) == 1);
  CHECK(pool.free() == 1);
  // Sequence 3 restarting with 12 tokens needs 3 blocks; the one it shares
  // stays held, so it gives back 1: 2 net (crediting all it owns said 1,
  // and the step would have run out of blocks).
  int net = 0;
  const std::vector<SeqInput> step{input(3, 12, 0)};
  const Status s = check_step_inputs(step, pool, 10, 64, 0, &net);
  CHECK(net == 2);
  CHECK_FALSE(s.ok());
}
