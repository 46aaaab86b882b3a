#!/usr/bin/env bash
# One GPU call: this build's GPU tests, and what structured output costs
# through the gateway on a real-size model (bench/gpu/tests_in_call.sh says
# what travels and what it makes), bench/structured/structured_speed.py on
# the Qwen1.5-shape folder (every expert resident).
#   bash bench/structured/device_check.sh      (results under $OUT)
set -uo pipefail
out=${OUT:-/tmp/structured-out}
. bench/gpu/tests_in_call.sh
timeout 300 python3 -u bench/structured/structured_speed.py --build /tmp/moe-bin --model $model --concurrency 1,8 \
  --new-tokens 128 --rounds 3 --json "$out/structured-speed.json" 2>&1 | tee "$out/structured-speed.txt"
echo "== $(date -u +%T) done"
