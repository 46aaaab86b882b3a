#!/usr/bin/env bash
# The KV cache in one byte on the GPU machine (docs/kv-cache.md), resumable
# across calls on one warm machine (state in /tmp/e2e-kv):
#   bench/e2e/kv_dtype_run.sh SECONDS
# Stages, each done once:
#   1. unpack .device-build/payload.tar.xz (bin/: moe-worker, moe-gateway, moe and the
#      GPU tests; tokenizer/) and the demo model's weights (.device-build/demo.safetensors.xz)
#   2. the GPU tests: moe_kernels_cuda_tests, moe_cuda_engine_tests (all of them)
#   3. a seeded random-weight Qwen3-30B-A3B folder and our packed file of it
#   4. bench/e2e/kv_dtype_ab.py: 8 and 12 GiB, KV bf16 and int8 with a 32 K
#      context (2,048 blocks), Qwen3-30B-A3B's recorded routing replayed, 1 and 8 streams
set -uo pipefail
limit=${1:-560}
deadline=$(($(date +%s) + limit))
W=/tmp/e2e-kv
source "$(dirname "${BASH_SOURCE[0]}")/run_state.sh"
collect() {
  cp -f $W/rows.jsonl $W/logs/tests-*.log "$out/" 2>/dev/null
  (cd $W && tar cJf "$out/kv-logs.tar.xz" logs state runs 2>/dev/null)
  true
}
trap collect EXIT
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
say "start on $(nvidia-smi -L | head -1)"
F=/dev/shm/e2e-kv
mkdir -p $F
unpack_payload
# tests/data/gguf stays here: not the GGUF cases
gpu_tests moe_kernels_cuda_tests "moe_cuda_engine_tests:~[gguf]"
if [ "$(left)" -gt 240 ]; then
  seeded_pack qwen3-30b-a3b $F/q3.moepack || exit 1
fi
if is_done pack && ! is_done rows; then
  say "kv_dtype_ab.py"
  PYTHONUNBUFFERED=1 python3 bench/e2e/kv_dtype_ab.py --packed $F/q3.moepack --bin $BIN \
    --routing replay:bench/e2e/traces/qwen3-30b-a3b.safetensors --budgets ${BUDGETS:-8GiB,12GiB} \
    --rows $W/rows.jsonl --work $W/runs --deadline $((deadline - 10)) 2>&1 | tee -a $W/logs/rows.log
  [ "${PIPESTATUS[0]}" = 0 ] && mark rows
fi
say "stop; state: $(ls $W/state | tr '\n' ' ')"
