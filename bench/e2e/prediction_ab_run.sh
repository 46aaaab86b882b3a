#!/usr/bin/env bash
# Expert prediction and grouped batching on and off through the gateway, on
# the GPU machine, at a real shape with its recorded routing replayed
# (resumable across calls on one warm machine; state in /tmp/e2e-pab-SHAPE):
#   bench/e2e/prediction_ab_run.sh SECONDS qwen1.5-moe-a2.7b|qwen3-30b-a3b
# Stages, each done once:
#   1. unpack .device-build/payload.tar.xz (bin/: moe-worker, moe-gateway, moe;
#      tokenizer/: the Qwen tokenizer)
#   2. a seeded random-weight checkpoint folder of the shape and our packed file of it
#   3. bench/e2e/prediction_ab.py under the shape's budget (6 GiB for Qwen1.5-MoE,
#      8 GiB for Qwen3-30B; BUDGET overrides), its recorded routing replayed
set -uo pipefail
limit=${1:-560}
shape=${2:?usage: prediction_ab_run.sh SECONDS qwen1.5-moe-a2.7b|qwen3-30b-a3b}
deadline=$(($(date +%s) + limit))
W=/tmp/e2e-pab-$shape
source "$(dirname "${BASH_SOURCE[0]}")/run_state.sh"
collect() {
  cp -f $W/rows.jsonl "$out/rows-$shape.jsonl" 2>/dev/null
  (cd $W && tar cJf "$out/pab-$shape-logs.tar.xz" logs state runs/*.log 2>/dev/null)
  true
}
trap collect EXIT
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
case $shape in
  qwen1.5-moe-a2.7b) budget=${BUDGET:-6GiB} ;;
  qwen3-30b-a3b) budget=${BUDGET:-8GiB} ;;
  *) echo "prediction_ab_run.sh: no shape $shape"; exit 2 ;;
esac
say "start on $(nvidia-smi -L | head -1)"
F=/dev/shm/e2e-pab
mkdir -p $F
unpack_payload
seeded_pack $shape $F/$shape.moepack || exit 1
if ! is_done rows; then
  say "prediction_ab.py"
  PYTHONUNBUFFERED=1 python3 bench/e2e/prediction_ab.py --packed $F/$shape.moepack --bin $BIN \
    --routing replay:bench/e2e/traces/$shape.safetensors --budget $budget --shape $shape \
    --rows $W/rows.jsonl --work $W/runs --deadline $((deadline - 10)) 2>&1 | tee -a $W/logs/rows.log
  [ "${PIPESTATUS[0]}" = 0 ] && mark rows
fi
say "stop; state: $(ls $W/state | tr '\n' ' ')"
