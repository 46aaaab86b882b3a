#pragma once
// Profiled ranges of moe-bench-engine (--profile-steps): a profiler started
// with its collection off (ncu --profile-from-start off) sees only the work
// between profile_begin and profile_end, led by a marker kernel whose grid
// size is `phase` (1, 2, ... in the order the bench prints them).

namespace moe::bench {

void profile_begin(int phase);
void profile_end();

}  // namespace moe::bench
