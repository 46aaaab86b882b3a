#!/usr/bin/env bash
# Starts moe-gateway (which starts and watches its own CPU worker) on the demo
# model at a free loopback port, waits for /health, runs one node test file
# against it, and stops the server whatever happened.
# Env: MOE_GATEWAY, MOE_CLI, MOE_MODEL, MOE_NODE_CACHE (set by CTest).
set -uo pipefail
test_file=$1
here=$(cd "$(dirname "$0")" && pwd)

if ! command -v node >/dev/null; then echo "SKIPPED: node is not installed"; exit 77; fi

# The official openai package, installed once per build folder.
mkdir -p "$MOE_NODE_CACHE"
if [ ! -d "$MOE_NODE_CACHE/node_modules/openai" ]; then
  (cd "$MOE_NODE_CACHE" && npm init -y >/dev/null 2>&1 &&
   npm install --no-audit --no-fund --silent openai@5.12.0) || { echo "npm install openai failed"; exit 1; }
fi
export NODE_PATH="$MOE_NODE_CACHE/node_modules"

port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
log=$(mktemp /tmp/moe-gw-XXXXXX.log)
"$MOE_GATEWAY" --model "$MOE_MODEL" --host 127.0.0.1 --port "$port" --api-key test-key >"$log" 2>&1 &
gw=$!
cleanup() { kill "$gw" 2>/dev/null; wait "$gw" 2>/dev/null; }
trap cleanup EXIT

for _ in $(seq 1 300); do
  curl -fs "http://127.0.0.1:$port/health" >/dev/null 2>&1 && break
  if ! kill -0 "$gw" 2>/dev/null; then echo "gateway exited early:"; cat "$log"; exit 1; fi
  sleep 0.2
done
curl -fs "http://127.0.0.1:$port/health" >/dev/null || { echo "gateway never became healthy:"; cat "$log"; exit 1; }

export MOE_BASE_URL="http://127.0.0.1:$port" MOE_API_KEY=test-key
# The test files import the openai package from MOE_NODE_CACHE.
node --test --test-reporter=spec "$test_file"
rc=$?
if [ $rc -ne 0 ]; then echo "---- gateway log"; tail -n 100 "$log"; fi
rm -f "$log"
exit $rc
