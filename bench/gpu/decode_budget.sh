#!/usr/bin/env bash
# Where a step's time goes, on the GPU machine: Nsight Compute over
# moe-bench-engine --profile-steps at the Qwen3-30B-A3B shape (seeded weights,
# uniform routing), all experts resident and under an 8 GiB budget (the host's
# share off, so that every kernel runs without waiting on host threads), then
# bench/gpu/kernel_budget.py's tables: each kernel's time and bytes a step
# against the step's wall time. docs/cuda-worker.md ("Where a decode step's
# time goes") has the result and the arithmetic.
#   bench/gpu/decode_budget.sh BENCH OUT [resident|8gib|both]
# BENCH: a moe-bench-engine binary. Writes OUT/NAME.{log,csv,json,txt} and the
# .ncu-rep reports. About 3 minutes on an H200.
set -uo pipefail
bench=${1:?usage: decode_budget.sh BENCH OUT [resident|8gib|both]}
out=${2:?usage: decode_budget.sh BENCH OUT [resident|8gib|both]}
which=${3:-both}
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$out"
ncu=$(command -v ncu || ls /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
[ -x "$ncu" ] || { echo "decode_budget: no ncu on this machine"; exit 1; }
profile() {  # NAME ARGS...
  local name=$1
  shift
  echo "== $(date -u +%T) $name: moe-bench-engine $*"
  "$ncu" --profile-from-start off --clock-control none \
    --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum \
    -f -o "$out/$name" "$bench" "$@" >"$out/$name.log" 2>&1 || { echo "   exit $?"; tail -5 "$out/$name.log"; }
  grep -E "tok/s|profiled phase" "$out/$name.log"
  "$ncu" --import "$out/$name.ncu-rep" --csv --page raw --print-units base >"$out/$name.csv" 2>&1
  python3 "$here/kernel_budget.py" "$out/$name.csv" "$out/$name.log" --json "$out/$name.json" | tee "$out/$name.txt"
}
common=(--shape qwen3 --dense-weights int8 --routing uniform --steps 12 --profile-steps 2)
[ "$which" = 8gib ] || profile qwen3-resident "${common[@]}"
[ "$which" = resident ] || profile qwen3-8gib "${common[@]}" --budget-dense-weights auto --vram-budget 8 \
  --skip-resident --budget-batches 1,8 --host-experts off
echo "== $(date -u +%T) done"
