#!/usr/bin/env bash
# The GPU product as a user starts it, on the GPU machine, in two calls on one
# warm machine (the second within 30 s of the first, so /tmp survives):
#   bench/gpu/product_check.sh 1 BIN_DIR TOKENIZER_DIR OUT_DIR
#     the GPU tests of this build; a seeded Qwen3-30B-A3B-shape checkpoint
#     folder (61 GB, the real Qwen3 tokenizer) made in /tmp/qwen3; the worker
#     started from that folder under --vram-budget 12GiB and driven through
#     the gateway (time to ready, host peak, GPU peak, tokens/s, TTFT, ITL);
#     the same engine alone on the same folder (moe-bench-engine --model)
#   bench/gpu/product_check.sh 2 BIN_DIR TOKENIZER_DIR OUT_DIR
#     the folder packed (moe convert, to /dev/shm when it has room), the
#     worker from the packed file under 8 and 6 GiB through the gateway, and
#     `deploy/run.sh`'s path: the gateway's own worker on the GPU by default
# BIN_DIR holds moe-worker, moe-gateway, moe, moe-bench-engine and the GPU test
# binaries (stripped, libuv/hiredis/pcre2/utf8proc linked in).
set -uo pipefail
part=$1
bin=$(cd "$2" && pwd)
tok=$(cd "$3" && pwd)
out=$4
mkdir -p "$out"
here=$(cd "$(dirname "$0")/../.." && pwd)
model=/tmp/qwen3
# The layout full_stack.py expects of a build folder.
fake=/tmp/moe-bin
mkdir -p $fake/worker $fake/gateway
ln -sf "$bin/moe-worker" $fake/worker/moe-worker
ln -sf "$bin/moe-gateway" $fake/gateway/moe-gateway
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
echo "== $(date -u +%FT%TZ) part $part on $(nvidia-smi -L | head -1)"
df -h / /dev/shm /tmp | sed 's/^/   /'
free -g | sed 's/^/   /'

if [ "$part" = 1 ]; then
  python3 "$here/bench/gpu/make_checkpoint.py" --shape qwen3-30b-a3b --out $model --tokenizer "$tok" \
    >"$out/make-checkpoint.txt" 2>&1 &
  maker=$!
  echo "== GPU tests"
  export MOE_TEST_DATA=$here/tests/data
  for t in moe_kernels_cuda_tests moe_cuda_engine_tests; do
    "$bin/$t" >"$out/$t.txt" 2>&1
    echo "   $t: exit $? -- $(grep -E 'test cases|passed|failed' "$out/$t.txt" | tail -1)"
  done
  MOE_WORKER_BIN=$bin/moe-worker MOE_TEST_WORKER_BACKEND=cuda "$bin/moe_worker_tests" >"$out/moe_worker_tests.txt" 2>&1
  echo "   moe_worker_tests (cuda): exit $? -- $(grep -E 'test cases|passed|failed' "$out/moe_worker_tests.txt" | tail -1)"
  wait $maker
  tail -1 "$out/make-checkpoint.txt"
  du -sh $model
  echo "== the worker from the folder, 12 GiB, through the gateway"
  python3 "$here/bench/gateway/full_stack.py" --build $fake --model $model --shape qwen3-30b-a3b --budgets 12GiB \
    --concurrency 1,8 --requests 3 --kv-blocks 144 --json "$out/full-stack-folder.json" 2>&1 | tee "$out/full-stack-folder.txt"
  echo "== the engine alone on the same folder, 12 GiB"
  "$bin/moe-bench-engine" --model $model --vram-budget 12 --skip-resident --budget-batches 1,8 --routing router,uniform \
    --json "$out/engine-folder.json" 2>&1 | tee "$out/engine-folder.txt" | grep -E "tok/s|ready|MiB" | head -20
fi

if [ "$part" = 2 ]; then
  if [ ! -f $model/config.json ]; then
    python3 "$here/bench/gpu/make_checkpoint.py" --shape qwen3-30b-a3b --out $model --tokenizer "$tok" \
      >"$out/make-checkpoint.txt" 2>&1 &
    maker=$!
    export MOE_TEST_DATA=$here/tests/data
    "$bin/moe_cuda_engine_tests" >"$out/moe_cuda_engine_tests.txt" 2>&1
    echo "   moe_cuda_engine_tests: exit $? -- $(grep -E 'test cases|passed|failed' "$out/moe_cuda_engine_tests.txt" | tail -1)"
    wait $maker
    tail -1 "$out/make-checkpoint.txt"
  fi
  packed=/dev/shm/qwen3.moepack
  avail=$(df --output=avail -B1 /dev/shm | tail -1)
  if [ "${avail:-0}" -lt $((20 * 1024 * 1024 * 1024)) ]; then packed=/tmp/qwen3.moepack; fi
  echo "== moe convert to $packed"
  /usr/bin/time -v "$bin/moe" convert --model $model --out $packed 2>"$out/convert.txt"
  grep -E "wrote|Maximum resident|Elapsed" "$out/convert.txt" | sed 's/^/   /'
  echo "== the worker from the packed file (page cache warm), 12, 8 and 6 GiB, through the gateway"
  python3 "$here/bench/gateway/full_stack.py" --build $fake --model $packed --shape qwen3-30b-a3b \
    --budgets 12GiB,8GiB,6GiB --concurrency 1,8 --requests 3 --kv-blocks 144 --json "$out/full-stack-packed.json" \
    2>&1 | tee "$out/full-stack-packed.txt"
  echo "== the engine alone on the packed file, the same budgets"
  "$bin/moe-bench-engine" --model $packed --vram-budget 12,8,6 --skip-resident --budget-batches 1,8 --routing router \
    --json "$out/engine-packed.json" 2>&1 | tee "$out/engine-packed.txt" | grep -E "tok/s|ready" | head -20
  echo "== deploy/run.sh's path: the gateway's own worker, no flags: which backend?"
  port=18080
  MOE_WORKER_BIN=$bin/moe-worker "$bin/moe-gateway" --model $packed --port $port --worker-arg --vram-budget \
    --worker-arg 6GiB >"$out/gateway-default.txt" 2>&1 &
  gw=$!
  python3 - $port <<'PY'
import http.client, sys, time
for _ in range(600):
    try:
        c = http.client.HTTPConnection("127.0.0.1", int(sys.argv[1]), timeout=2)
        c.request("GET", "/health")
        r = c.getresponse()
        body = r.read().decode()
        if r.status == 200:
            print("   /health:", body)
            break
    except OSError:
        pass
    time.sleep(0.5)
PY
  kill $gw; wait $gw
  grep -E "backend|ready" "$out/gateway-default.txt" | sed 's/^/   /'
fi
echo "== $(date -u +%FT%TZ) done"
