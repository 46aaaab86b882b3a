#!/usr/bin/env bash
# KV blocks and expert islands trading places on the GPU machine
# (docs/kv-islands-trade.md), resumable across calls on one warm machine
# (state in /tmp/e2e-kvt):
#   bench/e2e/kv_trade_run.sh SECONDS
# Stages, each done once:
#   1. unpack .device-build/payload.tar.xz (bin/: moe-worker, moe-gateway, moe and the
#      GPU tests; tokenizer/) and the demo model's weights (.device-build/demo.safetensors.xz)
#   2. the GPU tests: moe_residency_tests, moe_kernels_cuda_tests "[kv]", moe_cuda_engine_tests
#   3. a seeded random-weight Qwen3-30B-A3B folder and our packed file of it
#   4. bench/e2e/kv_trade.py: 8 GiB, Qwen3-30B-A3B's recorded routing replayed,
#      short chats before, during and after a 30,000-token prompt, --kv-trade on and off
set -uo pipefail
limit=${1:-560}
deadline=$(($(date +%s) + limit))
W=/tmp/e2e-kvt
source "$(dirname "${BASH_SOURCE[0]}")/run_state.sh"
collect() {
  cp -f $W/rows.jsonl $W/logs/tests-*.log "$out/" 2>/dev/null
  (cd $W && tar cJf "$out/kvt-logs.tar.xz" logs state runs 2>/dev/null)
  true
}
trap collect EXIT
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export MOE_TEST_DATA=$PWD/tests/data
say "start on $(nvidia-smi -L | head -1)"
F=/dev/shm/e2e-kvt
mkdir -p $F
unpack_payload
# tests/data/gguf stays here: not the GGUF cases
GREP_EXTRA="KV trade" gpu_tests moe_residency_tests "moe_kernels_cuda_tests:[kv]" "moe_cuda_engine_tests:~[gguf]"
if [ "$(left)" -gt 240 ]; then
  seeded_pack qwen3-30b-a3b $F/q3.moepack || exit 1
fi
if is_done pack && ! is_done rows; then
  say "kv_trade.py"
  PYTHONUNBUFFERED=1 python3 bench/e2e/kv_trade.py --packed $F/q3.moepack --bin $BIN \
    --routing replay:bench/e2e/traces/qwen3-30b-a3b.safetensors --budget ${BUDGET:-8GiB} \
    --rows $W/rows.jsonl --work $W/runs --deadline $((deadline - 10)) 2>&1 | tee -a $W/logs/rows.log
  [ "${PIPESTATUS[0]}" = 0 ] && mark rows
fi
say "stop; state: $(ls $W/state | tr '\n' ' ')"
