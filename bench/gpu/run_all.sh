#!/usr/bin/env bash
# The GPU benchmark in one call: the worker's engine at the Qwen1.5-MoE-A2.7B
# and Qwen3-30B-A3B shapes (seeded random weights made in memory, INT4
# experts), all experts resident (INT8 non-expert weights) and under the VRAM
# budgets of the targets (the worker's default dtype: INT4 where experts are
# left out; decode at batch 1 and 8 there too), with the router's own, with
# uniform routing and with a real model's recorded routing replayed
# (bench/e2e/traces);
# then transformers on the same shapes; then one table of ratios and targets
# and the summary JSON.
#   bench/gpu/run_all.sh BUILD_DIR OUT_DIR [COMMIT]
# Writes OUT_DIR/engine-qwen15.json, engine-qwen3.json, peer.json and
# gpu-latest.json (PEER=0: the two engine files only); the log goes to stdout. Takes about 4 minutes on an H200.
set -euo pipefail
build=${1:?usage: run_all.sh BUILD_DIR OUT_DIR [COMMIT]}
out=${2:?usage: run_all.sh BUILD_DIR OUT_DIR [COMMIT]}
commit=${3:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$out"
bench="$build/bench/gpu/moe-bench-engine"
# BENCH_ARGS: more options for every engine run (e.g. "--fused-decode on").
read -r -a extra <<< "${BENCH_ARGS:-}"
"$bench" --shape qwen15 --dense-weights int8 --budget-dense-weights auto --vram-budget 6 --budget-batches 1,8 --routing router,uniform,replay "${extra[@]}" --json "$out/engine-qwen15.json"
"$bench" --shape qwen3 --dense-weights int8 --budget-dense-weights auto --vram-budget 12,8 --budget-batches 1,8 --routing router,uniform,replay "${extra[@]}" --json "$out/engine-qwen3.json"
# PEER=0: the engine's rows only (a "before" run beside an "after" one).
[ "${PEER:-1}" = 0 ] && exit 0
python3 "$here/transformers_peer.py" --shape all --ours "$out/engine-qwen15.json,$out/engine-qwen3.json" \
    --json "$out/peer.json" --summary "$out/gpu-latest.json" --commit "$commit"
