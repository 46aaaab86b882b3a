#!/usr/bin/env bash
# A change to the GPU wing checked on the GPU machine, in one or two calls
# while the machine stays warm: `tests` runs the kernels' and the CUDA
# engine's test suites on the new binaries, moe-bench-engine at the
# Qwen3-30B-A3B shape (resident, uniform routing: decode b1 and b8, a
# 512-token prefill) with the binary of before and after, alternating, and
# moe-bench-kernels' kernel rows (new); `profile` runs
# bench/gpu/decode_budget.sh (Nsight Compute: where a step's time goes) and
# the kernel rows on the new binaries.
#   bench/gpu/before_after.sh SECONDS tests|profile
# Needs .device-build/p.tar.xz (p/new: stripped moe-bench-engine,
# moe-bench-kernels, moe_kernels_cuda_tests, moe_cuda_engine_tests; p/base:
# moe-bench-engine of before) and .device-build/demo.safetensors.xz where the
# tree lacks the demo model's weights. Results under $OUT.
set -uo pipefail
deadline=$(($(date +%s) + ${1:?usage: before_after.sh SECONDS tests|profile} - 10))
what=${2:?usage: before_after.sh SECONDS tests|profile}
W=/tmp/before-after
mkdir -p $W
out=${OUT:-$W/out}
mkdir -p "$out"
left() { echo $((deadline - $(date +%s))); }
say() { echo "== $(date -u +%T) [$(left) s left] $*"; }
[ -d $W/p ] || tar xJf .device-build/p.tar.xz -C $W || { say "no payload"; exit 1; }
[ -f models/demo-moe/model.safetensors ] || xz -dc .device-build/demo.safetensors.xz >models/demo-moe/model.safetensors
export MOE_TEST_DATA=$PWD/tests/data
NEW=$W/p/new BASE=$W/p/base
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
if [ "$what" = tests ]; then
  for t in moe_kernels_cuda_tests moe_cuda_engine_tests; do
    filter=""
    [ $t = moe_cuda_engine_tests ] && filter="~[gguf]"
    say "$t $filter"
    (timeout $(($(left) - 150)) $NEW/$t $filter) >"$out/$t.log" 2>&1
    echo "   exit $?"
    grep -E "^(test cases|assertions|All tests)|FAILED|vs cpu" "$out/$t.log" | tail -12
  done
  args=(--shape qwen3 --dense-weights int8 --routing uniform --steps 32)
  for run in base new base new; do
    [ "$(left)" -gt 70 ] || break
    bin=$BASE/moe-bench-engine
    [ $run = new ] && bin=$NEW/moe-bench-engine
    say "moe-bench-engine ($run) ${args[*]}"
    timeout $(($(left) - 5)) $bin "${args[@]}" --json "$out/engine-$run-$(date +%s).json" 2>&1 |
      grep -E "decode b|prefill b" | tee -a "$out/engine-$run.txt"
  done
  if [ "$(left)" -gt 40 ]; then
    say "moe-bench-kernels (new)"
    timeout $(($(left) - 5)) $NEW/moe-bench-kernels --shape qwen3 --only kernels --json "$out/kernels-qwen3.json" \
      >"$out/kernels-qwen3.txt" 2>&1
    grep -E "attention|grouped|q4 " "$out/kernels-qwen3.txt"
  fi
else
  say "decode_budget.sh (new)"
  timeout $(($(left) - 60)) bash bench/gpu/decode_budget.sh $NEW/moe-bench-engine "$out" both
  say "moe-bench-kernels (new)"
  timeout $(($(left) - 5)) $NEW/moe-bench-kernels --shape qwen3 --only kernels --json "$out/kernels-qwen3.json" \
    >"$out/kernels-qwen3.txt" 2>&1
  grep -E "attention|grouped|q4 " "$out/kernels-qwen3.txt"
  (cd "$out" && tar czf reports.tgz ./*.ncu-rep && rm -f ./*.ncu-rep ./*.csv)
fi
say "done"
