#!/usr/bin/env bash
# One call on the GPU machine after a change to the GPU wing: every GPU test
# suite, the benchmark of record (run_all.sh: the engine at both shapes,
# resident and under budgets, transformers beside it), and the product from
# a packed Qwen3-30B-A3B-shape file through the gateway at 12 GiB (time to
# ready, one stream and eight). Takes about 8 minutes on an H200.
#   bench/gpu/after_change.sh BIN_DIR TOKENIZER_DIR OUT_DIR
# BIN_DIR: stripped moe-worker, moe-gateway, moe, moe-bench-engine,
# moe-bench-kernels and the GPU test binaries (moe_kernels_cuda_tests,
# moe_cuda_engine_tests, moe_worker_tests); models/demo-moe must hold its
# weights (the CUDA engine tests read it).
set -uo pipefail
bin=$(cd "$1" && pwd)
tok=$(cd "$2" && pwd)
out=$3
mkdir -p "$out"
here=$(cd "$(dirname "$0")/../.." && pwd)
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export MOE_TEST_DATA=$here/tests/data
echo "== $(date -u +%FT%TZ) on $(nvidia-smi -L | head -1)"
model=/tmp/qwen3
python3 "$here/bench/gpu/make_checkpoint.py" --shape qwen3-30b-a3b --out $model --tokenizer "$tok" \
  >"$out/make-checkpoint.txt" 2>&1 &
maker=$!
echo "== GPU tests"
for t in moe_kernels_cuda_tests moe_cuda_engine_tests; do
  "$bin/$t" >"$out/$t.txt" 2>&1
  echo "   $t: exit $? -- $(grep -E 'test cases' "$out/$t.txt" | tail -1)"
done
MOE_WORKER_BIN=$bin/moe-worker MOE_TEST_WORKER_BACKEND=cuda "$bin/moe_worker_tests" >"$out/moe_worker_tests.txt" 2>&1
echo "   moe_worker_tests (cuda): exit $? -- $(grep -E 'test cases' "$out/moe_worker_tests.txt" | tail -1)"
wait $maker
tail -1 "$out/make-checkpoint.txt"
echo "== bench/gpu/run_all.sh"
fake=/tmp/moe-bin
mkdir -p $fake/bench/gpu $fake/worker $fake/gateway
ln -sf "$bin/moe-bench-engine" $fake/bench/gpu/moe-bench-engine
ln -sf "$bin/moe-worker" $fake/worker/moe-worker
ln -sf "$bin/moe-worker" $fake/worker/moe-worker
ln -sf "$bin/moe-gateway" $fake/gateway/moe-gateway
bash "$here/bench/gpu/run_all.sh" $fake "$out/run-all" >"$out/run-all.txt" 2>&1
echo "   exit $?"
grep -E "^\|" "$out/run-all.txt" | head -40
echo "== the packed file through the gateway, 12 GiB"
packed=/dev/shm/qwen3.moepack
"$bin/moe" convert --model $model --out $packed 2>"$out/convert.txt"
tail -1 "$out/convert.txt"
python3 "$here/bench/gateway/full_stack.py" --build $fake --model $packed --shape qwen3-30b-a3b --budgets 12GiB \
  --concurrency 1,8 --requests 3 --kv-blocks 144 --json "$out/full-stack-packed.json" 2>&1 | tee "$out/full-stack-packed.txt"
echo "== $(date -u +%FT%TZ) done"
