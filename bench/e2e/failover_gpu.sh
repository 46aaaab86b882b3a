#!/usr/bin/env bash
# Failover from a CUDA worker, on a machine where nothing is installed and
# nothing can be fetched: deploy/supervise.sh runs the carried supervisord and
# redis-server and the given moe-worker / moe-gateway, the main worker with
# BACKEND (cuda) and WORKER_ARGS, the CPU fallback worker, the gateway; 8
# concurrent greedy streams; kill -9 of the main worker mid-stream; a JSON of
# what it cost (bench/e2e/failover_gpu.py says each field;
# restart_to_first_token_s is counted from the kill -9, and
# process_start_to_first_token_s from the restarted process's start).
#
# Usage: bench/e2e/failover_gpu.sh BIN CARRY MODEL [OUT.json]
#   BIN    a folder with moe-worker and moe-gateway (e.g. stripped copies)
#   CARRY  .device-build/failover-carry.tar.xz, or the folder it unpacks to
#          (bench/e2e/prepare_failover_carry.sh makes it: redis-server and
#          its libraries, supervisord as a Python package; python3 >= 3.8
#          must be on the machine, 3.12 there)
#   MODEL  the model: a packed model file or a model folder
#   OUT    the JSON (default bench/results/failover_gpu.json)
# Env: BACKEND (cuda), WORKER_ARGS (the main worker's extra options, e.g.
#      "--vram-budget 10GiB"), FALLBACK_MODEL (the CPU fallback's model; the
#      main one by default: it must share its tokenizer), STREAMS (8),
#      MAX_TOKENS (128), FAILOVER_TIMEOUT_S (900, each wait), LOG_DIR (copy
#      the programs' logs there), COMMIT (else git rev-parse HEAD), KEEP=1
#      (keep the state folder).
#   bench/e2e/failover_gpu.sh --self-test CARRY   only checks that the carried
#      supervisord runs the carried redis-server on this machine.
# Tested on the CPU with the demo model (0 lost, texts equal, 8 s):
#   mkdir -p B && strip -o B/moe-worker build-cpu/worker/moe-worker &&
#   strip -o B/moe-gateway build-cpu/gateway/moe-gateway &&
#   BACKEND=cpu WORKER_ARGS="--threads 1" bench/e2e/failover_gpu.sh B \
#     .device-build/failover-carry.tar.xz models/demo-moe /tmp/f.json
# On the GPU machine both B (under .device-build/) and the carry travel as
# ignored paths; its python3 (3.12) runs supervisord from the carry.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
abs() { case $1 in /*) echo "$1" ;; *) echo "$(pwd)/$1" ;; esac; }
tmp=""
trap '[ -z "$tmp" ] || rm -rf "$tmp"' EXIT
unpack() {  # CARRY -> $carry, the failover-carry folder (a tarball unpacked under /tmp, removed at exit)
  local c; c=$(abs "$1")
  if [ -d "$c" ]; then
    for carry in "$c" "$c/failover-carry"; do [ -x "$carry/bin/supervisord" ] && return; done
  fi
  [ -f "$c" ] || { echo "failover_gpu: no carry at $c" >&2; exit 2; }
  tmp=$(mktemp -d /tmp/failover-carry-XXXXXX)
  tar -C "$tmp" -xJf "$c"
  carry=$tmp/failover-carry
}
if [ "${1:-}" = "--self-test" ]; then
  unpack "${2:?CARRY}"
  "$carry/bin/redis-server" --version
  "$carry/bin/supervisord" --version
  exit 0
fi
[ $# -ge 3 ] || { sed -n "2,/^set -euo/p" "$0" | sed "\$d" >&2; exit 2; }
bin=$(abs "$1"); unpack "$2"; model=$(abs "$3")
out=$(abs "${4:-$root/bench/results/failover_gpu.json}")
for p in moe-worker moe-gateway; do [ -x "$bin/$p" ] || { echo "failover_gpu: no $bin/$p" >&2; exit 2; }; done
export GATEWAY_BIN=$bin/moe-gateway WORKER_BIN=$bin/moe-worker
export SUPERVISORD=$carry/bin/supervisord REDIS_SERVER=$carry/bin/redis-server
export BACKEND=${BACKEND:-cuda} WORKER_ARGS=${WORKER_ARGS:-}
# One main worker (supervise.sh would start one a visible GPU): the probe after the kill must meet the restarted one.
export WORKERS=${WORKERS:-1}
# No keys on this private, loopback-only stack.
unset API_KEY_FILE MOE_API_KEY REDIS_PASSWORD_FILE
"$carry/bin/supervisord" --version >/dev/null ||
  { echo "failover_gpu: the carried supervisord does not run with $(python3 --version 2>&1)" >&2; exit 2; }
mkdir -p "$(dirname "$out")"
python3 -B -u "$root/bench/e2e/failover_gpu.py" "$model" "$out"
