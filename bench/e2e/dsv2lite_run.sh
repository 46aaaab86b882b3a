#!/usr/bin/env bash
# DeepSeek-V2-Lite through the gateway on the GPU machine, from a checkpoint
# folder (resumable across calls on one warm machine; state in /tmp/e2e-dsv2):
#   bench/e2e/dsv2lite_run.sh SECONDS
# Stages, each done once:
#   1. unpack .device-build/payload.tar.xz (bin/: moe-worker, moe-gateway, moe;
#      tokenizer/: the Qwen3 tokenizer, whose first 102,400 ids the shape reads)
#   2. a seeded random-weight DeepSeek-V2-Lite folder (bench/gpu/make_checkpoint.py)
#      and our packed file of it (moe convert)
#   3. bench/e2e/kv_dtype_ab.py with bf16 latent rows: a CUDA worker under 6 GiB
#      and one with room for every expert (24 GiB), a 600-block KV pool (9,600
#      tokens), uniform routing (no recording of DeepSeek's routing is public), 1 and 8 streams
set -uo pipefail
limit=${1:-560}
deadline=$(($(date +%s) + limit))
W=/tmp/e2e-dsv2
source "$(dirname "${BASH_SOURCE[0]}")/run_state.sh"
collect() {
  cp -f $W/rows.jsonl "$out/" 2>/dev/null
  (cd $W && tar cJf "$out/dsv2lite-logs.tar.xz" logs state runs 2>/dev/null)
  true
}
trap collect EXIT
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
say "start on $(nvidia-smi -L | head -1)"
F=/dev/shm/e2e-dsv2
mkdir -p $F
unpack_payload
seeded_pack deepseek-v2-lite $F/ds.moepack || exit 1
if ! is_done rows; then
  say "kv_dtype_ab.py"
  PYTHONUNBUFFERED=1 python3 bench/e2e/kv_dtype_ab.py --packed $F/ds.moepack --bin $BIN --routing uniform \
    --budgets ${BUDGETS:-6GiB,24GiB} --kv-dtypes bf16 --kv-blocks 600 --vocab 102400 --shape deepseek-v2-lite \
    --rows $W/rows.jsonl --work $W/runs --deadline $((deadline - 10)) 2>&1 | tee -a $W/logs/rows.log
  [ "${PIPESTATUS[0]}" = 0 ] && mark rows
fi
say "stop; state: $(ls $W/state | tr '\n' ' ')"
