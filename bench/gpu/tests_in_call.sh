# Sourced by the one-call GPU checks (bench/structured/device_check.sh,
# bench/prefix/device_check.sh): unpacks .device-build/gputests.tar.xz
# (bin/: moe-worker, moe-gateway and the GPU test binaries, stripped;
# tokenizer/: the Qwen3 tokenizer) to /tmp/g, starts a seeded
# Qwen1.5-MoE-A2.7B-shape folder in /dev/shm/q15 in the background, runs
# the GPU tests into $out, waits for the folder and lays out /tmp/moe-bin
# as a build folder for the bench scripts. Needs $out; sets $B and $model.
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
  echo "== $(date -u +%T) $t exit $?"
  grep -E "^(test cases|All tests)|FAILED|prefix cache|sampling controls" "$out/$t.txt" | head -12
done
MOE_TEST_WORKER_BACKEND=cuda timeout 120 $B/moe_worker_tests >"$out/moe_worker_tests-cuda.txt" 2>&1
echo "== $(date -u +%T) moe_worker_tests (cuda) exit $?"; tail -2 "$out/moe_worker_tests-cuda.txt"
wait $maker
tail -2 "$out/make_checkpoint.txt"
mkdir -p /tmp/moe-bin/worker /tmp/moe-bin/gateway
ln -sf $B/moe-worker /tmp/moe-bin/worker/moe-worker
ln -sf $B/moe-gateway /tmp/moe-bin/gateway/moe-gateway
