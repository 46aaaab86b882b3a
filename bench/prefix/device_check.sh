#!/usr/bin/env bash
# One GPU call: this build's CUDA engine and worker tests, and the 5-turn
# session of bench/prefix/session_ttft.py with the prefix cache on and off,
# on a seeded Qwen1.5-MoE-A2.7B-shape folder (the Qwen3 tokenizer) made in
# /dev/shm meanwhile. Unpacks .device-build/gputests.tar.xz (bin/ and
# tokenizer/, as bench/structured/device_check.sh).
#   bash bench/prefix/device_check.sh      (results under $OUT)
set -uo pipefail
out=${OUT:-/tmp/prefix-out}
mkdir -p "$out" /tmp/g
tar xJf .device-build/gputests.tar.xz -C /tmp/g
B=/tmp/g/bin
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export MOE_TEST_DATA=$PWD/tests/data MOE_WORKER_BIN=$B/moe-worker
echo "== $(date -u +%T) $(nvidia-smi -L | head -1)"
model=/dev/shm/q15
(python3 bench/gpu/make_checkpoint.py --shape qwen1.5-moe-a2.7b --out $model --tokenizer /tmp/g/tokenizer \
  >"$out/make_checkpoint.txt" 2>&1; echo done >>"$out/make_checkpoint.txt") &
maker=$!
for t in moe_kernels_cuda_tests moe_cuda_engine_tests; do
  timeout 240 $B/$t >"$out/$t.txt" 2>&1
  echo "== $(date -u +%T) $t exit $?"; grep -E "^(test cases|All tests)|FAILED|prefix cache|sampling controls" "$out/$t.txt" | head -12
done
MOE_TEST_WORKER_BACKEND=cuda timeout 120 $B/moe_worker_tests >"$out/moe_worker_tests-cuda.txt" 2>&1
echo "== $(date -u +%T) moe_worker_tests (cuda) exit $?"; tail -2 "$out/moe_worker_tests-cuda.txt"
wait $maker
tail -2 "$out/make_checkpoint.txt"
mkdir -p /tmp/moe-bin/worker /tmp/moe-bin/gateway
ln -sf $B/moe-worker /tmp/moe-bin/worker/moe-worker
ln -sf $B/moe-gateway /tmp/moe-bin/gateway/moe-gateway
timeout 300 python3 -u bench/prefix/session_ttft.py --build /tmp/moe-bin --model $model \
  --json "$out/session-ttft.json" 2>&1 | tee "$out/session-ttft.txt"
echo "== $(date -u +%T) done"
