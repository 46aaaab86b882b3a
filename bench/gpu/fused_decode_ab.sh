#!/usr/bin/env bash
# The fused decode pass (docs/fused-decode.md) on the GPU machine in one call:
# its engine tests ([fused], and the bit-exact budget test whose resident
# engine runs the chain), then moe-bench-engine at the Qwen3-30B-A3B shape,
# resident, INT8 dense, uniform routing, at ~140 and 2,048 keys: the fused
# pass with its phase stamps, the chain, and main's binary when given.
#   bench/gpu/fused_decode_ab.sh
# Needs .device-build/p.tar.xz (p/new: stripped moe_cuda_engine_tests and
# moe-bench-engine of the change; p/base: moe-bench-engine of main, optional)
# and .device-build/demo.safetensors.xz where the tree lacks the demo model's
# weights. Logs under $OUT (logs.tgz).
set -uo pipefail
W=/tmp/fused-ab; rm -rf $W; mkdir -p $W; out=${OUT:-/tmp/out}; mkdir -p "$out"
t0=$(date +%s); el() { echo "[$(( $(date +%s) - t0 )) s]"; }
tar xJf .device-build/p.tar.xz -C $W
[ -f models/demo-moe/model.safetensors ] || xz -dc .device-build/demo.safetensors.xz > models/demo-moe/model.safetensors
export MOE_TEST_DATA=$PWD/tests/data
N=$W/p/new B=$W/p/base
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
echo "== $(el) fused tests + the bit-exact budget test"
timeout 150 $N/moe_cuda_engine_tests "[fused],cuda engine: streamed passes staging the next layer's guessed experts give the resident outputs" > "$out/fused.log" 2>&1
echo "exit $?"
grep -E "fused decode,|FAILED|test cases|assertions" "$out/fused.log" | head -40
echo "== $(el) bench"
for args in "--dense-weights int8 --routing uniform" "--dense-weights int8 --routing uniform --context 2048"; do
  for f in "--fused-decode on --fused-stamps" "--fused-decode off" base; do
    bin=$N/moe-bench-engine; fl=$f
    if [ "$f" = base ]; then
      [ -x $B/moe-bench-engine ] || continue
      bin=$B/moe-bench-engine; fl=""
    fi
    timeout 90 $bin --shape qwen3 $args --steps 32 $fl 2>&1 | grep -E "decode b1|fused pass|rror" | sed "s/^/$f: /"
  done
done
(cd "$out" && tar czf logs.tgz ./*.log && rm -f ./*.log)
echo "== $(el) done"
