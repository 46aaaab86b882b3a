#!/usr/bin/env bash
# The first requests after a start, cold and from a warm profile, with the
# demo model's own trained router (real routing, no replay) on the GPU:
#   bench/e2e/warm_start_demo.sh SECONDS
# The profile comes from the first 60 % of the demo's held-out text, routed
# on the CPU engine (`moe profile --text`); the prompts are 12-line pieces of
# the other 40 %: traffic the profile never saw. A budget (BUDGET, default 982MiB:
# the worker process's CUDA context and libraries hold ~894 MiB; KV_BLOCKS 128)
# leaves the 192 experts fewer islands. Needs .device-build/payload.tar.xz
# (bin/: moe-worker, moe-gateway, moe) and the demo weights
# (.device-build/demo.safetensors.xz) when models/demo-moe/model.safetensors is absent.
set -uo pipefail
limit=${1:-300}
deadline=$(($(date +%s) + limit))
W=/tmp/e2e-warm-demo
source "$(dirname "${BASH_SOURCE[0]}")/run_state.sh"
trap 'cp -f $W/rows.jsonl $W/profile.txt "$out/" 2>/dev/null; (cd $W && tar cJf "$out/warm-demo-logs.tar.xz" runs logs 2>/dev/null); true' EXIT
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
say "start on $(nvidia-smi -L | head -1)"
[ -f models/demo-moe/model.safetensors ] || xz -dc .device-build/demo.safetensors.xz >models/demo-moe/model.safetensors
is_done unpack || { tar xJf .device-build/payload.tar.xz -C $W && mark unpack; }
BIN=$W/payload/bin
python3 - "$W" <<'PY'
import json, sys
w = sys.argv[1]
lines = open("models/demo-moe/eval.txt", encoding="utf-8").read().split("\n")
cut = int(len(lines) * 0.6)
open(w + "/profile-text.txt", "w", encoding="utf-8").write("\n".join(lines[:cut]))
rest = lines[cut:]
with open(w + "/prompts.jsonl", "w", encoding="utf-8") as f:
    for i in range(0, len(rest) - 12, 97):
        f.write(json.dumps("\n".join(rest[i:i + 12]) + "\n") + "\n")
PY
if ! is_done profile; then
  $BIN/moe profile --model models/demo-moe --text $W/profile-text.txt --out $W/demo.profile.json 2>$W/logs/profile.log &&
    $BIN/moe profile --show $W/demo.profile.json --islands 96 >$W/profile.txt && mark profile || { cat $W/logs/profile.log; exit 1; }
  head -3 $W/profile.txt
fi
say "warm_start.py on the demo model, --vram-budget ${BUDGET:-982MiB}"
PYTHONUNBUFFERED=1 python3 bench/e2e/warm_start.py --packed models/demo-moe --bin $BIN --profile $W/demo.profile.json \
  --routing router --mode ${BUDGET:-982MiB} --kv-blocks ${KV_BLOCKS:-128} --cycles ${CYCLES:-3} --concurrency ${CONCURRENCY:-1,8} \
  --new-tokens ${NEW_TOKENS:-100} --text-prompts $W/prompts.jsonl --shape demo-moe --rows $W/rows.jsonl \
  --work $W/runs --deadline $((deadline - 10)) 2>&1 | tee -a $W/logs/rows.log
grep -h "cuda backend on\|warmed" $W/runs/c0-n1-*-worker.log | head -3
say "stop"
