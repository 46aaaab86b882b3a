#!/usr/bin/env bash
# DeepSeek-V2 on the CUDA engine, on the GPU machine, resuming across calls
# while the machine stays warm (bench/e2e/run_state.sh): the latent
# attention kernels' tests, the CUDA engine's tests (DeepSeek-V2 against the
# CPU engine, under a budget, the prefix cache, its GGUF files, and every
# other case), then the DeepSeek-V2-Lite shape in moe-bench-engine, resident
# and under 6 GiB, and transformers on the same shape.
#   bench/gpu/mla_run.sh SECONDS [tests|bench|all]
# Needs .device-build/payload.tar.xz (stripped moe_kernels_cuda_tests,
# moe_cuda_engine_tests, moe-bench-engine under payload/bin) and the demo
# model's weights. Results under $OUT (default $W/out).
set -uo pipefail
deadline=$(($(date +%s) + ${1:?usage: mla_run.sh SECONDS [tests|bench|all]} - 15))
what=${2:-all}
W=${W:-/tmp/mla-run}
source bench/e2e/run_state.sh
unpack_payload || { say "no payload"; exit 1; }
export MOE_TEST_DATA=$PWD/tests/data
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
if [ "$what" != bench ]; then
  GREP_EXTRA="latent attention|DeepSeek|deepseek|prefix cache" gpu_tests \
    "moe_kernels_cuda_tests:[mla]" "moe_cuda_engine_tests:[mla]"
  for t in kernels:moe_kernels_cuda_tests engines:moe_cuda_engine_tests; do
    name=${t%%:*} bin=${t#*:}
    is_done "all-$name" && continue
    [ "$(left)" -gt 200 ] || break
    say "$bin, every case (GGUF but DeepSeek's aside: the files do not travel)"
    filter=""
    [ "$bin" = moe_cuda_engine_tests ] && filter="~[gguf]"
    (timeout $(($(left) - 30)) "$BIN/$bin" $filter) >"$W/logs/all-$name.log" 2>&1 && mark "all-$name" ||
      say "$bin exited $?"
    grep -E "^(test cases|assertions)|FAILED|vs cpu|prefix cache|latent" "$W/logs/all-$name.log" | tail -30
  done
  for stem in deepseek_v2-q8_0 deepseek_v2-q4_k_m; do
    is_done "gguf-$stem" && continue
    say "GGUF $stem"
    "$BIN/moe_cuda_engine_tests" "cuda engine: GGUF files made by llama.cpp serve as on the CPU engine" -c "$stem" \
      >"$W/logs/gguf-$stem.log" 2>&1 && mark "gguf-$stem"
    grep -E "^(test cases|assertions)|FAILED|vs cpu" "$W/logs/gguf-$stem.log" | tail -4
  done
  cp "$W"/logs/*.log "$out/" 2>/dev/null
fi
if [ "$what" != tests ]; then
  if ! is_done bench && [ "$(left)" -gt 240 ]; then
    say "moe-bench-engine --shape dsv2lite: resident, and 6 GiB"
    "$BIN/moe-bench-engine" --shape dsv2lite --dense-weights int8 --budget-dense-weights auto --vram-budget 6 \
      --budget-batches 1,8 --routing router,uniform --json "$out/engine-dsv2lite.json" 2>&1 |
      tee "$W/logs/bench.log" | grep -vE "^moe-worker: experts to INT4" && mark bench
  fi
  if ! is_done context && [ "$(left)" -gt 150 ]; then
    say "resident at context 2048"
    "$BIN/moe-bench-engine" --shape dsv2lite --dense-weights int8 --context 2048 --routing uniform \
      --json "$out/engine-dsv2lite-ctx2048.json" 2>&1 | tee "$W/logs/context.log" | grep -E "decode|prefill|ready" &&
      mark context
  fi
  if ! is_done peer && [ "$(left)" -gt 150 ]; then
    say "transformers on the same shape"
    timeout $(($(left) - 20)) python3 bench/gpu/transformers_peer.py --shape dsv2lite --ours "$out/engine-dsv2lite.json" \
      --json "$out/peer-dsv2lite.json" --summary "$out/dsv2lite-latest.json" 2>&1 | tee "$W/logs/peer.log" |
      grep -vE "Warning|warn" && mark peer
  fi
  cp "$W"/logs/*.log "$out/" 2>/dev/null
fi
say "done"
