#!/usr/bin/env bash
# The first requests after a start, cold and from a warm profile, on the GPU
# machine (resumable across calls on one warm machine; state in /tmp/e2e-warm):
#   bench/e2e/warm_start_run.sh SECONDS
# Stages, each done once:
#   1. unpack .device-build/payload.tar.xz (bin/: moe-worker, moe-gateway, moe;
#      tokenizer/: the Qwen tokenizer)
#   2. a seeded random-weight Qwen1.5-MoE-A2.7B folder (bench/gpu/make_checkpoint.py)
#      and our packed file of it (moe convert)
#   3. the warm profile: `moe profile --trace` of the recorded routing the
#      worker replays (bench/e2e/traces/), what `--save-profile` would hold
#      after serving that traffic
#   4. bench/e2e/warm_start.py: per cycle, concurrency 1 and 8, a cold start
#      and a warm one, each measured over its first requests (rows.jsonl)
# Environment: BUDGET (default 6GiB), CYCLES (3), CONCURRENCY (1,8), NEW_TOKENS (100).
set -uo pipefail
limit=${1:-560}
deadline=$(($(date +%s) + limit))
W=/tmp/e2e-warm
source "$(dirname "${BASH_SOURCE[0]}")/run_state.sh"
collect() {
  cp -f $W/rows.jsonl $W/*.profile.txt "$out/" 2>/dev/null
  (cd $W && tar cJf "$out/warm-start-logs.tar.xz" logs state runs 2>/dev/null)
  true
}
trap collect EXIT
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
say "start on $(nvidia-smi -L | head -1)"
F=/dev/shm/e2e-warm
TRACE=bench/e2e/traces/qwen1.5-moe-a2.7b.safetensors
mkdir -p $F
if ! is_done unpack; then
  tar xJf .device-build/payload.tar.xz -C $W && mark unpack
fi
BIN=$W/payload/bin
TOK=$W/payload/tokenizer
seeded_pack qwen1.5-moe-a2.7b $F/q15.moepack || exit 1
P=$W/q15.profile.json
if ! is_done profile; then
  $BIN/moe profile --model $F/q15.moepack --trace $TRACE --tensor routing_topk --out $P &&
    $BIN/moe profile --show $P --islands 338 >$W/q15.profile.txt && mark profile || exit 1
  head -3 $W/q15.profile.txt
fi
if ! is_done rows; then
  say "warm_start.py: ${BUDGET:-6GiB}, concurrency ${CONCURRENCY:-1,8}, ${CYCLES:-3} cycles"
  PYTHONUNBUFFERED=1 python3 bench/e2e/warm_start.py --packed $F/q15.moepack --bin $BIN --profile $P \
    --routing replay:$TRACE --mode ${BUDGET:-6GiB} --cycles ${CYCLES:-3} --concurrency ${CONCURRENCY:-1,8} \
    --new-tokens ${NEW_TOKENS:-100} --rows $W/rows.jsonl --work $W/runs --deadline $((deadline - 10)) \
    2>&1 | tee -a $W/logs/rows.log
  [ "${PIPESTATUS[0]}" = 0 ] && mark rows
fi
say "stop; state: $(ls $W/state | tr '\n' ' ')"
