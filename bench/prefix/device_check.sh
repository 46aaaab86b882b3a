#!/usr/bin/env bash
# One GPU call: this build's GPU tests (bench/gpu/tests_in_call.sh), and the
# 5-turn session of bench/prefix/session_ttft.py with the prefix cache on
# and off, on the Qwen1.5-shape folder.
#   bash bench/prefix/device_check.sh      (results under $OUT)
set -uo pipefail
out=${OUT:-/tmp/prefix-out}
. bench/gpu/tests_in_call.sh
timeout 300 python3 -u bench/prefix/session_ttft.py --build /tmp/moe-bin --model $model \
  --json "$out/session-ttft.json" 2>&1 | tee "$out/session-ttft.txt"
echo "== $(date -u +%T) done"
