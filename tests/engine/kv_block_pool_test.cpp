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

TEST_CASE("KvBlockPool hands out the lowest ids first and reuses the last freed first", "[kv]") {
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
  // Freed 0, 1, 3 in that order: 3 comes back first.
  CHECK(pool.extend(9, 0, 1) == std::vector<int32_t>{3});
  // A restart at 0 gives back what the sequence held before taking again.
  CHECK(pool.extend(8, 0, 8) == std::vector<int32_t>{2, 1});
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
