#!/usr/bin/env bash
# The side-by-side run on the GPU machine, resumable across calls on one warm
# machine (state in /tmp/e2e; each call within 30 s of the last keeps it):
#   bench/e2e/device_run.sh SECONDS
# runs what is left, stopping before SECONDS have passed, and copies the rows
# and logs to $OUT. The stages, each done once:
#   1. unpack .device-build/payload.tar.xz (our stripped binaries and the
#      Qwen tokenizer) and .device-build/llama-src.tar.xz (llama.cpp's
#      source); build llama-server and llama-quantize with CUDA in the
#      background (sm_90), out of this tree
#   2. our GPU tests, in the background
#   3. per shape (Qwen1.5-MoE-A2.7B, then Qwen3-30B-A3B): a seeded
#      random-weight HF folder (bench/gpu/make_checkpoint.py), then from it,
#      at once, our packed file (moe convert) and a Q8_0 GGUF
#      (bench/e2e/hf_to_gguf.py, llama.cpp's own metadata), the folder
#      deleted; then llama.cpp's llama-quantize to Q4_K_M
#   4. bench/e2e/side_by_side.py per shape, uniform and replayed routing
#   5. bench/e2e/failover_gpu.sh, when it is there and time is left
#   and, once the first packed file exists, the card's health through the
#   product (bench/gpu/card_metrics.py; CARD_CHECK=0 leaves it out)
#
# Environment (a run that fills in rows missing from an earlier one):
#   SHAPES="q3 q15"           the shapes to make and run (q3: Qwen3-30B-A3B,
#                             q15: Qwen1.5-MoE-A2.7B)
#   Q3_MODES, Q15_MODES       side_by_side.py --modes per shape (defaults
#                             resident,12GiB,8GiB and resident,6GiB)
#   SKIP_TESTS=1              leave out stage 2 (e.g. when the demo weights
#                             stayed behind to keep the tree under 64 MiB)
#   LLAMA_RESIDENT_MIB=N      llama-server's resident peak from an earlier run of
#                             the shape (e2e-latest.json), for modes without
#                             the resident row (Q3_MODES=8GiB: 22152 for q3)
#   FAILOVER_SHAPE=q3         whose packed file the failover run serves, and
#   FAILOVER_BUDGET=12GiB     under which budget
set -uo pipefail
limit=${1:-560}
SHAPES=${SHAPES:-q3 q15}
want() { [[ " $SHAPES " == *" $1 "* ]]; }
t_start=$(date +%s)
deadline=$((t_start + limit))
here=$(pwd)
W=/tmp/e2e
source "$(dirname "${BASH_SOURCE[0]}")/run_state.sh"
avail() { df --output=avail -B1 "$1" | tail -1; }
# A folder with room for N GB: the disk first, else /dev/shm.
room_for() {
  local need=$(( ($1 + 3) * 1000000000 ))
  if [ "$(avail /tmp)" -gt $need ]; then echo /tmp/e2e/files; else echo /dev/shm/e2e; fi
}
collect() {
  cp -f $W/rows-*.jsonl "$out/" 2>/dev/null
  (cd $W && tar cJf "$out/logs.tar.xz" logs state $(ls -d runs-* 2>/dev/null) 2>/dev/null)
  cp -f $W/failover-gpu.json "$out/" 2>/dev/null
  cp -f $W/card/card-metrics.json $W/card/metrics-*.txt "$out/" 2>/dev/null
  true
}
trap collect EXIT
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
say "start on $(nvidia-smi -L | head -1)"
df -h / /tmp /dev/shm | sed 's/^/   /'
free -g | sed 's/^/   /'

if ! is_done unpack; then
  tar xJf .device-build/payload.tar.xz -C $W && mkdir -p $W/llama-src &&
    tar xJf .device-build/llama-src.tar.xz -C $W/llama-src --strip-components=1 && mark unpack
fi
BIN=$W/payload/bin
TOK=$W/payload/tokenizer
mkdir -p /tmp/e2e/files /dev/shm/e2e

if ! is_done llama-started; then
  mark llama-started
  setsid nohup bash -c "cmake -S $W/llama-src -B $W/llama-build -G Ninja -DGGML_CUDA=ON \
      -DCMAKE_CUDA_ARCHITECTURES=90 -DLLAMA_CURL=OFF -DCMAKE_BUILD_TYPE=Release -DLLAMA_BUILD_TESTS=OFF \
      -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DGGML_CUDA_NCCL=OFF >/dev/null && cmake --build $W/llama-build -j 16 --target llama-server \
      llama-quantize && touch $W/state/llama-built" >$W/logs/llama-build.log 2>&1 </dev/null &
  say "llama.cpp building in the background"
fi

if ! is_done tests-started && [ "${SKIP_TESTS:-0}" != 1 ]; then
  mark tests-started
  setsid nohup bash -c "export MOE_TEST_DATA=$here/tests/data MOE_WORKER_BIN=$BIN/moe-worker;
    for t in moe_kernels_cuda_tests moe_cuda_engine_tests; do $BIN/\$t >$W/logs/\$t.txt 2>&1; echo \"\$t exit \$?\" >>$W/logs/gpu-tests.txt; done;
    MOE_TEST_WORKER_BACKEND=cuda $BIN/moe_worker_tests >$W/logs/moe_worker_tests-cuda.txt 2>&1; echo \"moe_worker_tests (cuda) exit \$?\" >>$W/logs/gpu-tests.txt" \
    >/dev/null 2>&1 </dev/null &
fi

quantize() {  # shape: Q8_0 -> Q4_K_M with llama.cpp's own tool, once built
  # In the background (setsid): 30 B took 290 s and 14 B 102 s on 16 cores,
  # more than a call has left; a later call waits for it.
  local s=$1
  is_done $s-q4 && return 0
  is_done $s-converted || return 1
  is_done llama-built || return 1
  if ! is_done $s-q4-started; then
    local q8; q8=$(cat $W/state/$s-q8.path)
    local dst; dst=$(room_for $([ $s = q3 ] && echo 19 || echo 10))/$s-q4_k_m.gguf
    say "$s: llama-quantize Q8_0 -> Q4_K_M into $dst (in the background)"
    mark $s-q4-started
    setsid nohup bash -c "/usr/bin/time -f '   %e s, peak RSS %M KB' $W/llama-build/bin/llama-quantize \
      --allow-requantize $q8 $dst Q4_K_M && echo $dst >$W/state/$s-q4.path && rm -f $q8 && touch $W/state/$s-q4" \
      >$W/logs/$s-quantize.log 2>&1 </dev/null &
  fi
  while ! is_done $s-q4 && [ "$(left)" -gt 30 ] && pgrep -f "llama-quantize.*$s-q8" >/dev/null; do sleep 2; done
  is_done $s-q4 && tail -1 $W/logs/$s-quantize.log
  is_done $s-q4
}

make_shape() {  # s shape-name
  local s=$1 shape=$2 gb=$3
  is_done $s-converted && return 0
  [ "$(left)" -gt 240 ] || return 1
  local hf=/dev/shm/e2e/$s-hf
  [ "$(avail /dev/shm)" -gt $(( (gb + 6) * 1000000000 )) ] || hf=/tmp/e2e/files/$s-hf
  if ! is_done $s-hf; then
    rm -rf $hf
    say "$s: a seeded $shape checkpoint folder in $hf"
    python3 bench/gpu/make_checkpoint.py --shape $shape --out $hf --tokenizer $TOK >$W/logs/$s-make.log 2>&1 ||
      { tail -5 $W/logs/$s-make.log; return 1; }
    tail -1 $W/logs/$s-make.log
    echo $hf >$W/state/$s-hf.path
    mark $s-hf
  fi
  hf=$(cat $W/state/$s-hf.path)
  # Our packed file first, then the GGUF, which deletes each shard of the
  # folder once written (the disk cannot hold the folder and both files).
  local pack; pack=$(room_for $(( gb * 3 / 10 + 2 )))/$s.moepack
  if ! is_done $s-pack; then
    say "$s: moe convert -> $pack"
    /usr/bin/time -f "   moe convert: %e s, peak RSS %M KB" $BIN/moe convert --model $hf --out $pack \
      >$W/logs/$s-convert.log 2>&1 || { tail -3 $W/logs/$s-convert.log; return 1; }
    tail -2 $W/logs/$s-convert.log
    echo $pack >$W/state/$s-pack.path
    mark $s-pack
  fi
  local need=$(( gb * 53 / 100 + 2 ))
  local q8=/dev/shm/e2e/$s-q8_0.gguf
  case $hf in /tmp/*) [ $(( $(avail /tmp) / 1000000000 + gb )) -gt $(( need + 4 )) ] && q8=/tmp/e2e/files/$s-q8_0.gguf ;;
              *) [ $(( $(avail /tmp) / 1000000000 )) -gt $(( need + 4 )) ] && q8=/tmp/e2e/files/$s-q8_0.gguf ;; esac
  say "$s: hf_to_gguf.py -> $q8 (llama.cpp's --vocab-only metadata; shards deleted as written)"
  /usr/bin/time -f "   hf_to_gguf: %e s, peak RSS %M KB" python3 bench/e2e/hf_to_gguf.py "$hf" --llama-cpp $W/llama-src \
    --out "$q8" --delete-consumed -j 10 >$W/logs/$s-gguf.log 2>&1 || { tail -5 $W/logs/$s-gguf.log; return 1; }
  tail -2 $W/logs/$s-gguf.log
  echo $pack >$W/state/$s-pack.path
  echo $q8 >$W/state/$s-q8.path
  rm -rf "$hf"
  mark $s-converted
}

# The card's health through the product (docs/operations.md): NVML from the
# card test, and /metrics of a gateway + CUDA worker on the first packed file
# made, before any timed row (CARD_CHECK=0 leaves it out).
card_check() {
  local s=$1
  [ "${CARD_CHECK:-1}" = 1 ] && ! is_done card-check && is_done $s-pack && [ "$(left)" -gt 200 ] || return 0
  mark card-check
  [ -x $BIN/moe_card_tests ] && $BIN/moe_card_tests >$W/logs/moe_card_tests.txt 2>&1
  echo "moe_card_tests exit $?" >>$W/logs/gpu-tests.txt
  mkdir -p $W/cardbuild/worker $W/cardbuild/gateway $W/card
  ln -sf $BIN/moe-worker $W/cardbuild/worker/moe-worker
  ln -sf $BIN/moe-gateway $W/cardbuild/gateway/moe-gateway
  say "card health through /metrics ($s, ${CARD_BUDGET:-8GiB})"
  timeout 240 python3 bench/gpu/card_metrics.py --build $W/cardbuild --model "$(cat $W/state/$s-pack.path)" \
    --budget ${CARD_BUDGET:-8GiB} --out $W/card >$W/logs/card-metrics.log 2>&1
  echo "card_metrics exit $?" >>$W/logs/gpu-tests.txt
  tail -30 $W/logs/card-metrics.log
  cp -f $W/card/card-metrics.json $W/card/metrics-*.txt "$out/" 2>/dev/null
  true
}

# Qwen3 first, while the disk is empty; Qwen1.5 while llama.cpp still builds.
if want q3; then make_shape q3 qwen3-30b-a3b 61 || say "q3 not made yet"; fi
if want q3; then card_check q3; fi
if want q3; then quantize q3 || true; fi
if want q15; then is_done llama-built || make_shape q15 qwen1.5-moe-a2.7b 27 || say "q15 not made yet"; fi
while ! is_done llama-built && [ "$(left)" -gt 200 ] && pgrep -f "llama-build" >/dev/null; do sleep 5; done
is_done llama-built || { say "llama.cpp not built yet:"; tail -5 $W/logs/llama-build.log; }
if want q3; then quantize q3 || true; fi
if want q15; then
  make_shape q15 qwen1.5-moe-a2.7b 27 || say "q15 not made yet"
  card_check q15
  quantize q15 || true
fi
df -h /tmp /dev/shm | sed 's/^/   /'
[ -f $W/logs/gpu-tests.txt ] && sed 's/^/   /' $W/logs/gpu-tests.txt

run_shape() {
  local s=$1 shape=$2 modes=$3
  is_done $s-runs && return 0
  is_done $s-q4 && is_done $s-converted || return 1
  [ "$(left)" -gt 150 ] || return 1
  say "$s: side by side ($modes)"
  mkdir -p $W/runs-$s
  PYTHONUNBUFFERED=1 python3 bench/e2e/side_by_side.py --shape $shape --packed "$(cat $W/state/$s-pack.path)" \
    --gguf "$(cat $W/state/$s-q4.path)" --bin $BIN --llama-bin $W/llama-build/bin --modes $modes \
    --routings uniform,replay:bench/e2e/traces/$shape.safetensors --resident-routings uniform \
    --requests-at-1 2 --long-max-concurrency 8 --tokenizer $TOK/tokenizer.json --rows $W/rows-$s.jsonl \
    --deadline $((deadline - 15)) --work $W/runs-$s ${LLAMA_RESIDENT_MIB:+--llama-resident-mib $LLAMA_RESIDENT_MIB} \
    2>&1 | tee -a $W/logs/$s-runs.log
  [ "${PIPESTATUS[0]}" = 0 ] && mark $s-runs
}
if want q3; then run_shape q3 qwen3-30b-a3b ${Q3_MODES:-resident,12GiB,8GiB} || true; fi
if want q15; then run_shape q15 qwen1.5-moe-a2.7b ${Q15_MODES:-resident,6GiB} || true; fi

fs=${FAILOVER_SHAPE:-q3}
all_runs=1
for s in $SHAPES; do is_done $s-runs || all_runs=0; done
if [ $all_runs = 1 ] && is_done $fs-pack && [ -x bench/e2e/failover_gpu.sh ] && ! is_done failover && [ "$(left)" -gt 150 ]; then
  say "failover from the CUDA worker ($fs, ${FAILOVER_BUDGET:-12GiB})"
  LOG_DIR=$W/logs/failover WORKER_ARGS="--vram-budget ${FAILOVER_BUDGET:-12GiB}" bash bench/e2e/failover_gpu.sh "$BIN" \
    .device-build/failover-carry.tar.xz "$(cat $W/state/$fs-pack.path)" $W/failover-gpu.json 2>&1 |
    tee $W/logs/failover.log && mark failover
fi
say "stop; state: $(ls $W/state | tr '\n' ' ')"
