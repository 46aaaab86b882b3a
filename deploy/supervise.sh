#!/usr/bin/env bash
# Runs moe-serve under supervisord in the foreground: Redis, the worker
# (BACKEND, cpu by default), the CPU fallback worker (by default the same
# model), and the gateway with --worker,
# --fallback-worker and --redis. Every program is restarted when it exits.
#
# Usage: deploy/supervise.sh [MODEL]   (default: the demo model)
# Env: BUILD_DIR (build), HOST (127.0.0.1), PORT (8080), REDIS_PORT (6390),
#      MOE_STATE_DIR (BUILD_DIR/supervise: sockets, Redis data, logs/),
#      FALLBACK_MODEL (the main model; it must share its tokenizer),
#      BACKEND (cpu; cuda once moe-worker has that backend).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${BUILD_DIR:-build}
case $build in /*) ;; *) build=$root/$build ;; esac
if [ ! -x "$build/gateway/moe-gateway" ] || [ ! -x "$build/gpu_worker/moe-worker" ]; then
  "$root/deploy/setup.sh" "$build"
fi
command -v supervisord >/dev/null || { echo "supervise: supervisord is not installed (deploy/setup.sh installs it)" >&2; exit 1; }

state=${MOE_STATE_DIR:-$build/supervise}
mkdir -p "$state/run" "$state/logs"
chmod 700 "$state/run"
export MOE_ROOT=$root MOE_BUILD=$build MOE_RUN_DIR=$state/run MOE_LOG_DIR=$state/logs
model=${1:-$root/models/demo-moe}
export MOE_MODEL=$(cd "$(dirname "$model")" && pwd)/$(basename "$model")
# The fallback continues running requests from their token ids, so it must
# share the main model's tokenizer: by default it is the main model itself
# (on the CPU); give FALLBACK_MODEL for a smaller one of the same vocabulary.
export MOE_FALLBACK_MODEL=${FALLBACK_MODEL:-$MOE_MODEL}
export MOE_HOST=${HOST:-127.0.0.1} MOE_PORT=${PORT:-8080} MOE_REDIS_PORT=${REDIS_PORT:-6390}
# moe-worker has only its CPU backend so far (the CUDA kernels and the island
# arena are built and benchmarked on their own, not yet behind the worker's
# Backend interface): a GPU machine runs the main worker on the CPU too until
# BACKEND=cuda can be given.
BACKEND=${BACKEND:-cpu}
export MOE_BACKEND=$BACKEND
echo "supervise: $MOE_MODEL on $MOE_BACKEND, fallback $MOE_FALLBACK_MODEL on cpu, http://$MOE_HOST:$MOE_PORT," \
     "Redis on 127.0.0.1:$MOE_REDIS_PORT, logs in $MOE_LOG_DIR" >&2
exec supervisord -n -c "$root/deploy/supervisord.conf"
