#!/usr/bin/env bash
# A change to the GPU wing checked on the GPU machine, in one or two calls
# while the machine stays warm: `tests` runs the kernels' and the CUDA
# engine's test suites on the new binaries, moe-bench-engine at the
# Qwen3-30B-A3B shape (resident, uniform routing: decode b1 and b8, a
# 512-token prefill) with the binary of before and after, alternating, and
# moe-bench-kernels' kernel rows (new); `profile` runs
# bench/gpu/decode_budget.sh (Nsight Compute: where a step's time goes) and
# the kernel rows on the new binaries.
# `run_all` runs bench/gpu/run_all.sh with the binary of before, then of
# after (BASE_COMMIT and NEW_COMMIT name them in its JSON), into $OUT/base
# and $OUT/new; SIDES (base new) their order, BASE_PEER=0 / NEW_PEER=0 a
# side's run without transformers.
# EXTRA (tests): more builds of after, each p/NAME/moe-bench-engine, run
# beside base and new in every round.
#   bench/gpu/before_after.sh SECONDS tests|profile|run_all
# Needs .device-build/p.tar.xz (p/new: stripped moe-bench-engine,
# moe-bench-kernels, moe_kernels_cuda_tests, moe_cuda_engine_tests; p/base:
# moe-bench-engine of before) and .device-build/demo.safetensors.xz where the
# tree lacks the demo model's weights. Results under $OUT.
# NEW_FLAGS (tests): the new binary's engine runs, one per ';'-separated set
# of moe-bench-engine flags (the switches a change brings), each beside the
# base run in every round; unset: the new binary once, as it is.
# BENCH_ARGS (tests): ';'-separated moe-bench-engine argument sets, each run
# by every binary in every round (default: the resident Qwen3 rows above).
# ABLATE (tests): moe-bench-engine --omit sets for the new binary, run after
# the rounds ("none;qkv;attention;..."): each kernel's share of a step as it
# runs among the others. ROUNDS: rounds of base and new runs (2).
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
  IFS=';' read -r -a sets <<<"${NEW_FLAGS:-}"
  [ ${#sets[@]} -gt 0 ] || sets=("")
  IFS=';' read -r -a arg_sets <<<"${BENCH_ARGS:-${args[*]}}"
  for round in $(seq 1 "${ROUNDS:-2}"); do
    for a in "${!arg_sets[@]}"; do
    read -r -a args <<<"${arg_sets[$a]}"
    for run in base "${sets[@]/#/new}" ${EXTRA:-}; do
      [ "$(left)" -gt 70 ] || break 2
      bin=$BASE/moe-bench-engine
      flags=()
      if [ -x "$W/p/$run/moe-bench-engine" ] && [ "$run" != new ]; then
        bin=$W/p/$run/moe-bench-engine
      elif [ "$run" != base ]; then
        bin=$NEW/moe-bench-engine
        read -r -a flags <<<"${run#new}"
      fi
      tag=$(echo "$run" | tr -c 'a-zA-Z0-9\n' '_' | sed 's/__*/_/g; s/_$//')
      say "moe-bench-engine ($run) ${args[*]}"
      timeout $(($(left) - 5)) $bin "${args[@]}" "${flags[@]}" --json "$out/engine-$tag-$round-$a.json" 2>&1 |
        grep -E "decode b|prefill b|routing: engine ready|host's share" | sed "s/^/$tag: /" | tee -a "$out/engine-$tag.txt"
    done
    done
  done
  if [ -n "${ABLATE:-}" ] && [ "$(left)" -gt 40 ]; then
    say "moe-bench-engine (new) --omit '$ABLATE'"
    timeout $(($(left) - 5)) $NEW/moe-bench-engine "${args[@]}" --omit "$ABLATE" --json "$out/ablate.json" 2>&1 |
      grep -E "decode b|engine ready" | tee "$out/ablate.txt"
  fi
  if [ "$(left)" -gt 40 ]; then
    say "moe-bench-kernels (new)"
    timeout $(($(left) - 5)) $NEW/moe-bench-kernels --shape qwen3 --only kernels --json "$out/kernels-qwen3.json" \
      >"$out/kernels-qwen3.txt" 2>&1
    grep -E "attention|grouped|q4 " "$out/kernels-qwen3.txt"
  fi
elif [ "$what" = run_all ]; then
  for side in ${SIDES:-base new}; do
    d=$W/build-$side/bench/gpu
    mkdir -p $d
    ln -sf $W/p/$side/moe-bench-engine $d/moe-bench-engine
    commit=${BASE_COMMIT:-before}
    [ $side = new ] && commit=${NEW_COMMIT:-after}
    say "run_all.sh ($side, $commit)"
    peer=${NEW_PEER:-1}
    [ $side = base ] && peer=${BASE_PEER:-1}
    PEER=$peer timeout $(($(left) - 5)) bash bench/gpu/run_all.sh $W/build-$side "$out/$side" "$commit" \
      >"$out/run_all-$side.log" 2>&1
    echo "   exit $?"
    grep -E "decode b|prefill b|engine ready" "$out/run_all-$side.log" | head -40
  done
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
