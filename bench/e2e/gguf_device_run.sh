#!/usr/bin/env bash
# Our server on a GGUF file at a real size, as a user who has one starts it:
# moe-gateway + moe-worker --backend cuda --model X.gguf, measured through
# HTTP beside the same server on our own packed file of the same checkpoint.
# On the GPU machine, resumable across calls on one warm machine (state in
# /tmp/e2e-gguf; each call within 30 s of the last keeps it):
#   bench/e2e/gguf_device_run.sh SECONDS
# Stages, each done once:
#   1. unpack .device-build/payload.tar.xz (bin/: moe-worker, moe-gateway, moe;
#      tokenizer/: the Qwen tokenizer) and .device-build/llama-src.tar.xz;
#      build llama.cpp's llama-quantize (CPU) in the background
#   2. a seeded random-weight Qwen1.5-MoE-A2.7B folder (bench/gpu/make_checkpoint.py),
#      our packed file of it (moe convert), and a Q8_0 GGUF (bench/e2e/hf_to_gguf.py:
#      llama.cpp's converter's metadata, its Q8_0 blocks bit for bit)
#   3. llama-quantize --allow-requantize Q8_0 -> Q4_K_M (llama.cpp's own tool)
#   4. bench/e2e/side_by_side.py --servers ours, on the Q4_K_M GGUF and on the
#      packed file: resident and 6GiB, uniform routing, concurrency 1 and 8,
#      128-token prompts, 128 new tokens (rows-gguf.jsonl, rows-packed.jsonl)
# Environment: MODES (default resident,6GiB), CONCURRENCY (1,8), PROMPTS (128), ROWS (which
# files: "gguf packed").
set -uo pipefail
limit=${1:-560}
deadline=$(($(date +%s) + limit))
W=/tmp/e2e-gguf
source "$(dirname "${BASH_SOURCE[0]}")/run_state.sh"
collect() {
  cp -f $W/rows-*.jsonl "$out/" 2>/dev/null
  (cd $W && tar cJf "$out/gguf-logs.tar.xz" logs state runs-* 2>/dev/null)
  true
}
trap collect EXIT
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
say "start on $(nvidia-smi -L | head -1)"
F=/dev/shm/e2e-gguf
mkdir -p $F

if ! is_done unpack; then
  tar xJf .device-build/payload.tar.xz -C $W && mkdir -p $W/llama-src &&
    tar xJf .device-build/llama-src.tar.xz -C $W/llama-src --strip-components=1 && mark unpack
fi
BIN=$W/payload/bin
TOK=$W/payload/tokenizer

if ! is_done llama-started; then
  mark llama-started
  setsid nohup bash -c "cmake -S $W/llama-src -B $W/llama-build -G Ninja -DGGML_CUDA=OFF -DGGML_NATIVE=OFF \
      -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DCMAKE_BUILD_TYPE=Release -DLLAMA_BUILD_TESTS=OFF \
      -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_BUILD_UI=OFF \
      -DLLAMA_USE_PREBUILT_UI=OFF >/dev/null && cmake --build $W/llama-build -j 8 --target llama-quantize &&
      touch $W/state/llama-built" >$W/logs/llama-build.log 2>&1 </dev/null &
  say "llama-quantize building in the background"
fi

if ! is_done hf; then
  say "a seeded Qwen1.5-MoE-A2.7B checkpoint folder in $F/hf"
  rm -rf $F/hf
  python3 bench/gpu/make_checkpoint.py --shape qwen1.5-moe-a2.7b --out $F/hf --tokenizer $TOK >$W/logs/make.log 2>&1 &&
    mark hf || { tail -5 $W/logs/make.log; exit 1; }
  tail -1 $W/logs/make.log
fi
if ! is_done pack; then
  say "moe convert -> $F/q15.moepack"
  /usr/bin/time -f "   moe convert: %e s, peak RSS %M KB" $BIN/moe convert --model $F/hf --out $F/q15.moepack \
    >$W/logs/convert.log 2>&1 && mark pack || { tail -3 $W/logs/convert.log; exit 1; }
  tail -2 $W/logs/convert.log
fi
if ! is_done q8; then
  say "hf_to_gguf.py -> $F/q15-q8_0.gguf (llama.cpp's converter's metadata)"
  /usr/bin/time -f "   hf_to_gguf: %e s, peak RSS %M KB" python3 bench/e2e/hf_to_gguf.py $F/hf --llama-cpp $W/llama-src \
    --out $F/q15-q8_0.gguf --delete-consumed -j 10 >$W/logs/gguf.log 2>&1 && mark q8 || { tail -5 $W/logs/gguf.log; exit 1; }
  tail -2 $W/logs/gguf.log
  rm -rf $F/hf
fi
while ! is_done llama-built && [ "$(left)" -gt 60 ] && pgrep -f "llama-build" >/dev/null; do sleep 3; done
if ! is_done q4; then
  is_done llama-built || { say "llama-quantize not built:"; tail -5 $W/logs/llama-build.log; exit 1; }
  say "llama-quantize Q8_0 -> Q4_K_M"
  /usr/bin/time -f "   llama-quantize: %e s, peak RSS %M KB" $W/llama-build/bin/llama-quantize --allow-requantize \
    $F/q15-q8_0.gguf $F/q15-q4_k_m.gguf Q4_K_M 16 >$W/logs/quantize.log 2>&1 && mark q4 ||
    { tail -5 $W/logs/quantize.log; exit 1; }
  grep -E "model size|quant size|total time" $W/logs/quantize.log | sed 's/^/   /'
  tail -1 $W/logs/quantize.log
  rm -f $F/q15-q8_0.gguf
fi
ls -la $F | sed 's/^/   /'

run_rows() {  # name model-path
  local name=$1 model=$2
  is_done rows-$name && return 0
  [ "$(left)" -gt 150 ] || return 1
  say "ours on $name ($model)"
  mkdir -p $W/runs-$name
  PYTHONUNBUFFERED=1 python3 bench/e2e/side_by_side.py --shape qwen1.5-moe-a2.7b --servers ours --packed "$model" \
    --gguf $F/q15-q4_k_m.gguf --bin $BIN --llama-bin /nonexistent --modes ${MODES:-resident,6GiB} \
    --routings uniform --concurrency ${CONCURRENCY:-1,8} --prompts ${PROMPTS:-128} --requests-at-1 2 \
    --tokenizer $TOK/tokenizer.json --rows $W/rows-$name.jsonl --deadline $((deadline - 15)) --work $W/runs-$name \
    2>&1 | tee -a $W/logs/rows-$name.log
  [ "${PIPESTATUS[0]}" = 0 ] && mark rows-$name
}
[[ " ${ROWS:-gguf packed} " == *" gguf "* ]] && { run_rows gguf $F/q15-q4_k_m.gguf || true; }
[[ " ${ROWS:-gguf packed} " == *" packed "* ]] && { run_rows packed $F/q15.moepack || true; }
say "stop; state: $(ls $W/state | tr '\n' ' ')"
