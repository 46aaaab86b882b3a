#!/usr/bin/env bash
# The GGUF fixtures of tests/data/gguf/, made by llama.cpp's own tools, and what llama.cpp
# computes on them. Needs python3 with torch, transformers and numpy, a C++ compiler, CMake;
# no network, no GPU. From the repository root:
#
#   bash tests/data/gguf/make/make_gguf_fixtures.sh
#
# Inputs: llama.cpp's source as .device-build/llama-src.tar.xz (bench/e2e/prepare_llama_source.sh
# makes it from a checkout; LLAMA_SRC_TAR overrides the path, LLAMA_COMMIT names the commit), the
# fixture checkpoints tests/data/fixtures/*/ and models/demo-moe/.
# Output in $OUT (default build-gguf/): make.log, manifest.json and the fixtures as
# gguf-fixtures.tar.xz.part0, .part1, ... (cat them together, then tar xJf): the split keeps each
# piece under 16 MB. Every step is logged and runs whatever failed before it; failures are listed
# at the end and in manifest.json. BUDGET (seconds, default 500) bounds the whole run: steps
# are cut short so that the results are packed in time.
#
# Steps (README.md beside this folder says what each file holds):
#   1. llama.cpp built for the CPU (llama, llama-quantize, llama-tokenize), and
#      make/llama_reference.cpp against it, in the background while
#   2. convert_hf_to_gguf.py (through make/convert.py) writes <name>-q8_0.gguf and
#      <name>-bf16.gguf per tiny fixture, demo-moe-q8_0.gguf and a bf16 demo intermediate;
#   3. llama-quantize: <name>-q4_k_m.gguf from each bf16 file, demo-moe-q4_k_m.gguf and
#      demo-moe-mixed.gguf (per-tensor types) from the demo's bf16 file;
#   4. llama_reference on every GGUF: <stem>.llama.safetensors and <stem>.llama.json;
#   5. gguf-py on every GGUF: <stem>.gguf.json, <stem>.dequant.safetensors, <stem>.dequant.json;
#   6. fixtures.py compare: llama.cpp against transformers' reference files -> compare.json;
#   7. manifest.json, and the pack.
set -u
cd "$(dirname "${BASH_SOURCE[0]}")/../../../.." || exit 1
ROOT=$(pwd)
MAKE=tests/data/gguf/make
OUT=${OUT:-$ROOT/build-gguf}
W=${GGUF_WORK:-/tmp/gguf-work}
LLAMA_COMMIT=${LLAMA_COMMIT:-3f545beccee69d9975f466ec7e45fd9aacd8ba90}
SRC_TAR=${LLAMA_SRC_TAR:-.device-build/llama-src.tar.xz}
BUDGET=${BUDGET:-500}
NJ=$(nproc)
TINY="qwen2_moe qwen3_moe mixtral olmoe qwen2_dense deepseek_v2"
T0=$(date +%s)

rm -rf "$W"
mkdir -p "$W/stage" "$W/extra" "$W/logs" "$W/req" "$OUT"
exec > >(tee "$OUT/make.log") 2>&1

left() { echo $((T0 + BUDGET - $(date +%s))); }
say() { echo "== [$(($(date +%s) - T0)) s] $*"; }
# The command as recorded in manifest.json: work paths as $W, repository paths relative.
rec() { printf '%s\n' "$*" | sed "s#$W#\$W#g; s#$ROOT/##g" >>"$W/commands.txt"; }
# step NAME CMD...: runs CMD (an executable) with its output in logs/NAME.log, cut off so that
# RESERVE seconds of the budget stay for the pack; never stops the script.
RESERVE=45
step() {
  local name=$1; shift
  local lim=$(($(left) - RESERVE)) t=$(date +%s) rc
  if [ "$lim" -lt 5 ]; then
    say "SKIP $name (out of time)"; echo "$name skipped: out of time" >>"$W/failures.txt"; return 124
  fi
  rec "$@"
  timeout -k 5 "$lim" "$@" >"$W/logs/$name.log" 2>&1
  rc=$?
  if [ $rc -eq 0 ]; then
    say "ok   $name ($(($(date +%s) - t)) s)"
  else
    say "FAIL $name (rc $rc, $(($(date +%s) - t)) s):"
    tail -n 30 "$W/logs/$name.log" | sed 's/^/    | /'
    echo "$name rc=$rc" >>"$W/failures.txt"
  fi
  return $rc
}
# Background jobs: at most N at a time, and all of them (a plain `wait` would also wait for
# the tee behind the log).
throttle() { while [ "$(jobs -rp | wc -l)" -ge "$1" ]; do sleep 0.2; done; }
wait_all() { local p; for p in $(jobs -p); do wait "$p"; done; }

say "start: $(uname -m), $NJ cores, $(python3 --version 2>&1), llama.cpp $LLAMA_COMMIT"
python3 -c 'import torch, transformers, numpy; print("torch", torch.__version__, "transformers", transformers.__version__, "numpy", numpy.__version__)'
c++ --version | head -1; cmake --version | head -1

# ---------------------------------------------------------------- 1. llama.cpp
step unpack tar xJf "$SRC_TAR" -C "$W" || { say "no llama.cpp source: nothing can be made"; exit 1; }
LL=$W/llama.cpp
GEN=(); command -v ninja >/dev/null && GEN=(-G Ninja)
cat >"$W/build.sh" <<EOF
set -e
cmake -S $LL -B $W/build ${GEN[*]} -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=OFF -DGGML_NATIVE=OFF \\
  -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \\
  -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF
cmake --build $W/build -j $NJ --target llama llama-quantize llama-tokenize
c++ -O2 -std=c++17 -I$LL/include -I$LL/ggml/include $ROOT/$MAKE/llama_reference.cpp \\
  -L$W/build/bin -lllama -lggml -lggml-base -Wl,-rpath,$W/build/bin -o $W/llama_reference
EOF
rec "$(cat "$W/build.sh")"
step build bash "$W/build.sh" &

# ---------------------------------------------------------------- 2. conversion
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1 OMP_NUM_THREADS=2
CONVERT=(python3 "$MAKE/convert.py" --llama-cpp "$LL")
for n in $TINY; do
  for t in q8_0 bf16; do
    throttle 6
    step "convert-$n-$t" "${CONVERT[@]}" "tests/data/fixtures/$n" --outtype $t --outfile "$W/stage/$n-$t.gguf" &
  done
done
throttle 6; step convert-demo-q8_0 "${CONVERT[@]}" models/demo-moe --outtype q8_0 --outfile "$W/stage/demo-moe-q8_0.gguf" &
throttle 6; step convert-demo-bf16 "${CONVERT[@]}" models/demo-moe --outtype bf16 --outfile "$W/extra/demo-moe-bf16.gguf" &
for n in $TINY demo-moe; do step "requests-$n" python3 "$MAKE/fixtures.py" requests "$n" "$W/req/$n.json"; done
wait_all
unset OMP_NUM_THREADS
[ -x "$W/llama_reference" ] || say "llama.cpp or llama_reference did not build: steps 3-4 will fail"

# ---------------------------------------------------------------- 3. quantisation
Q=$W/build/bin/llama-quantize
for n in $TINY; do
  [ -f "$W/stage/$n-bf16.gguf" ] || continue
  step "quantize-$n" "$Q" "$W/stage/$n-bf16.gguf" "$W/stage/$n-q4_k_m.gguf" Q4_K_M "$NJ" && continue
  # llama.cpp loads DeepSeek-V2 without q_lora_rank only for the published Lite models' layer
  # counts (see reference() below); llama-quantize then writes the override into the file.
  [ "$n" = deepseek_v2 ] && step "quantize-$n-override" "$Q" --override-kv deepseek2.attention.q_lora_rank=int:0 \
    "$W/stage/$n-bf16.gguf" "$W/stage/$n-q4_k_m.gguf" Q4_K_M "$NJ"
done
if [ -f "$W/extra/demo-moe-bf16.gguf" ]; then
  step quantize-demo-q4_k_m "$Q" "$W/extra/demo-moe-bf16.gguf" "$W/extra/demo-moe-q4_k_m.gguf" Q4_K_M "$NJ"
  # Q4_K_M as the base (output.weight stays Q6_K), every other kind of weight overridden so
  # that the file holds Q4_0 Q4_1 Q5_0 Q5_1 Q8_0 Q4_K Q5_K Q6_K F16 BF16 (and F32 norms and
  # router). First matching pattern wins. ffn_down_exps rows are 128 long: no K-quant there.
  step quantize-demo-mixed "$Q" --token-embedding-type q8_0 \
    --tensor-type attn_q=q4_0 --tensor-type attn_k=q4_1 --tensor-type attn_v=q5_0 \
    --tensor-type 'blk\.0\.attn_output=f16' --tensor-type 'blk\.1\.attn_output=bf16' --tensor-type attn_output=q5_1 \
    --tensor-type ffn_gate_exps=q4_K --tensor-type ffn_up_exps=q5_K \
    --tensor-type 'blk\.[01]\.ffn_down_exps=q8_0' --tensor-type 'blk\.[23]\.ffn_down_exps=q4_0' --tensor-type ffn_down_exps=q5_0 \
    "$W/extra/demo-moe-bf16.gguf" "$W/stage/demo-moe-mixed.gguf" Q4_K_M "$NJ"
fi
if [ ! -f "$W/stage/demo-moe-mixed.gguf" ] && [ -f "$W/extra/demo-moe-q4_k_m.gguf" ]; then
  say "no mixed file: demo-moe-q4_k_m.gguf goes back instead"
  mv "$W/extra/demo-moe-q4_k_m.gguf" "$W/stage/"
fi

# ---------------------------------------------------------------- 4. llama.cpp's outputs
reference() {  # GGUF: llama_reference with the model's requests
  local g=$1 stem; stem=$(basename "$g" .gguf)
  local model=${stem%-*}
  local ov=()
  step "reference-$stem" "$W/llama_reference" "$g" "$W/req/$model.json" "$W/stage/$stem" --threads 4 && return 0
  # llama.cpp reads DeepSeek-V2 without q_lora_rank only for the layer counts of the published
  # Lite models (src/models/deepseek2.cpp, is_lite): tell its loader the rank is 0 instead.
  if [ "$model" = deepseek_v2 ]; then
    ov=(--override-kv deepseek2.attention.q_lora_rank=int:0)
    step "reference-$stem-override" "$W/llama_reference" "$g" "$W/req/$model.json" "$W/stage/$stem" --threads 4 "${ov[@]}"
  fi
}
GGUFS=$(ls "$W"/stage/*.gguf "$W"/extra/demo-moe-q4_k_m.gguf 2>/dev/null)
for g in $GGUFS; do throttle 4; reference "$g" & done
wait_all
for g in $GGUFS; do
  case $g in *-bf16.gguf|*demo-moe-q8_0.gguf) step "tokenize-$(basename "$g" .gguf)" "$W/build/bin/llama-tokenize" -m "$g" -p "Hello world" --ids --log-disable &&
    echo "   llama-tokenize $(basename "$g") 'Hello world': $(tail -1 "$W/logs/tokenize-$(basename "$g" .gguf).log")" ;; esac
done

# ---------------------------------------------------------------- 5. gguf-py: listing, dequantised tensors
for g in $GGUFS; do
  throttle "$NJ"
  stem=$(basename "$g" .gguf)
  case $stem in demo-*) caps="65536 4096" ;; *) caps="8192 1024" ;; esac
  step "inspect-$stem" env PYTHONPATH="$LL/gguf-py" python3 "$MAKE/fixtures.py" inspect "$g" "$W/stage/$stem" $caps &
done
wait_all
for g in $GGUFS; do
  stem=$(basename "$g" .gguf)
  [ -f "$W/stage/$stem.gguf.json" ] && python3 -c "import json,sys; j=json.load(open(sys.argv[1])); print('   %-28s %9d bytes  %s' % (j['file'], j['size'], j['type_counts']))" "$W/stage/$stem.gguf.json"
done

# ---------------------------------------------------------------- 6. against transformers
step compare python3 "$MAKE/fixtures.py" compare "$W/stage" "$W/stage/compare.json" && cat "$W/logs/compare.log"

# ---------------------------------------------------------------- 7. manifest, pack
cp "$W/commands.txt" "$W/stage/commands.txt"
[ -f "$W/failures.txt" ] && cp "$W/failures.txt" "$W/stage/failures.txt"
(cd "$W/logs" && tar cJf "$W/stage/logs.tar.xz" .)
python3 "$MAKE/fixtures.py" manifest "$W/stage" "$W/stage/manifest.json" "$LLAMA_COMMIT" "$W/commands.txt" "$W/stage/compare.json"
cp "$W/stage/manifest.json" "$OUT/manifest.json"
ls -la "$W/stage" "$W/extra"

# What comes back: 64 MiB at most in all, 16 MiB a file, 8 files. Largest-last-to-lose first.
LIMIT=${PACK_LIMIT:-64000000}
DROP=(demo-moe-q4_k_m.llama.safetensors demo-moe-q4_k_m.dequant.safetensors 'qwen*-bf16.llama.safetensors'
      '*-bf16.llama.safetensors' '*-q4_k_m.llama.safetensors' logs.tar.xz)
pack() { (cd "$W/stage" && tar cf - .) | xz -T"$NJ" -6 >"$W/pack.tar.xz"; stat -c %s "$W/pack.tar.xz"; }
size=$(pack)
say "pack: $size bytes"
for d in "${DROP[@]}"; do
  [ "$size" -le "$LIMIT" ] && break
  say "pack over $LIMIT bytes: leaving out $d"
  (cd "$W/stage" && rm -f $d)
  echo "left out of the pack: $d" >>"$OUT/left-out.txt"
  size=$(pack)
  say "pack: $size bytes"
done
split -b 15000000 -d -a 1 "$W/pack.tar.xz" "$OUT/gguf-fixtures.tar.xz.part"
ls -la "$OUT"
if [ -f "$W/failures.txt" ]; then say "failures:"; sed 's/^/   /' "$W/failures.txt"; else say "no failures"; fi
say "done"
sleep 1  # let tee write the end of make.log
