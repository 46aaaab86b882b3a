#!/usr/bin/env bash
# Runs moe-serve under supervisord in the foreground: Redis, the main
# workers (BACKEND: cuda when a GPU is visible and moe-worker was built with
# CUDA, else cpu; one per GPU), the CPU fallback worker (by default the same model), and the
# gateway with --worker,
# --fallback-worker and --redis. Every program is restarted when it exits.
#
# Usage: deploy/supervise.sh [MODEL]   (default: the demo model)
# Env: BUILD_DIR (build), HOST (127.0.0.1), PORT (8080), REDIS_PORT (6390),
#      MOE_STATE_DIR (BUILD_DIR/supervise: sockets, Redis data, logs/),
#      FALLBACK_MODEL (the main model; it must share its tokenizer),
#      BACKEND (cuda | cpu; default as above), WORKERS (main workers: by
#      default one per visible GPU with the cuda backend, else 1; worker i
#      gets --device i), WORKER_ARGS (more moe-worker options for each main
#      worker, e.g. "--vram-budget 10GiB"),
#      API_KEY_FILE (the gateway's keys, one a line; MOE_API_KEY in the
#      environment works too: supervisord passes it on), KEYS_FILE (keys with
#      a name, priority and rate limit: moe-gateway --keys-file, see
#      docs/operations.md), OVERLOAD_WAIT_MS (default 10000) and
#      OVERLOAD_QUEUE_DEPTH (default 0: off): past either, new requests go to
#      the fallback worker (X-Moe-Degraded: 1); GATEWAY_ARGS (more moe-gateway
#      options, words split), WORKER_NAME and FALLBACK_NAME (the workers'
#      names in Redis and /metrics, default worker and fallback: unique per
#      host when several hosts share one Redis), REDIS_PASSWORD_FILE
#      (a password for Redis, first line: Redis, the workers and the gateway
#      read it from files, so it never shows in ps), REDIS_URL (a Redis
#      shared by several hosts, redis://HOST:PORT: none is started here),
#      WARM_PROFILE (the main worker's routing profile, kept with
#      --save-profile and warmed from at each start: default
#      MOE_STATE_DIR/WORKER_NAME.profile.json; "off": none).
#   Programs from elsewhere than the build and PATH (a machine where nothing
#   is installed, bench/e2e/failover_gpu.sh): GATEWAY_BIN, WORKER_BIN (the
#   executables; default BUILD_DIR/gateway/moe-gateway, BUILD_DIR/worker/
#   moe-worker; when both are given nothing is built), SUPERVISORD (the
#   command that runs supervisord, words split, e.g. a wrapper setting
#   PYTHONPATH; default supervisord), REDIS_SERVER (redis-server's path).
#
# Refused before anything starts: a FALLBACK_MODEL folder whose tokenizer.json
# differs from the main model's (the fallback continues requests from their
# token ids). A packed model file is not compared here; the gateway compares
# every worker's vocabulary with its model's at hello and refuses another.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${BUILD_DIR:-build}
case $build in /*) ;; *) build=$root/$build ;; esac
export MOE_GATEWAY_BIN=${GATEWAY_BIN:-$build/gateway/moe-gateway} MOE_WORKER_BIN=${WORKER_BIN:-$build/worker/moe-worker}
if [ ! -x "$MOE_GATEWAY_BIN" ] || [ ! -x "$MOE_WORKER_BIN" ]; then
  if [ -n "${GATEWAY_BIN:-}${WORKER_BIN:-}" ]; then
    echo "supervise: GATEWAY_BIN $MOE_GATEWAY_BIN or WORKER_BIN $MOE_WORKER_BIN is not an executable" >&2; exit 1
  fi
  "$root/deploy/setup.sh" "$build"
fi

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
case $MOE_FALLBACK_MODEL in /*) ;; *) MOE_FALLBACK_MODEL=$(pwd)/$MOE_FALLBACK_MODEL ;; esac
if [ "$MOE_FALLBACK_MODEL" != "$MOE_MODEL" ] && [ -d "$MOE_MODEL" ] && [ -d "$MOE_FALLBACK_MODEL" ]; then
  main_tok=$(sha256sum < "$MOE_MODEL/tokenizer.json" 2>/dev/null || echo "none")
  fb_tok=$(sha256sum < "$MOE_FALLBACK_MODEL/tokenizer.json" 2>/dev/null || echo "none")
  if [ "$main_tok" != "$fb_tok" ]; then
    echo "supervise: FALLBACK_MODEL $MOE_FALLBACK_MODEL has another tokenizer than $MOE_MODEL" \
         "(their tokenizer.json differ): the fallback continues requests from their token ids, so" \
         "both must share one tokenizer; give a fallback model of the same vocabulary, or none" >&2
    exit 1
  fi
fi
export MOE_HOST=${HOST:-127.0.0.1} MOE_PORT=${PORT:-8080} MOE_REDIS_PORT=${REDIS_PORT:-6390}
# REDIS_URL: a Redis elsewhere, shared by several hosts (docs/scale-out.md);
# then none is started here.
export MOE_REDIS_URL=${REDIS_URL:-redis://127.0.0.1:$MOE_REDIS_PORT} MOE_REDIS_LOCAL=true
[ -n "${REDIS_URL:-}" ] && MOE_REDIS_LOCAL=false
export MOE_REDIS_SERVER=${REDIS_SERVER:-$(command -v redis-server || echo /usr/bin/redis-server)}
[ "$MOE_REDIS_LOCAL" = false ] || [ -x "$MOE_REDIS_SERVER" ] ||
  { echo "supervise: redis-server is not installed (deploy/setup.sh installs it; or give REDIS_SERVER)" >&2; exit 1; }
read -r -a supervisord_cmd <<< "${SUPERVISORD:-supervisord}"
command -v "${supervisord_cmd[0]}" >/dev/null ||
  { echo "supervise: supervisord is not installed (deploy/setup.sh installs it; or give SUPERVISORD)" >&2; exit 1; }
# The main worker runs on the GPU when there is one and this moe-worker can
# use it (a binary built without the CUDA toolkit says so in its --help).
if [ -z "${BACKEND:-}" ]; then
  BACKEND=cpu
  if command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1 &&
     "$MOE_WORKER_BIN" --help | grep -q "cuda backend: built"; then
    BACKEND=cuda
  fi
fi
export MOE_WORKER_ARGS=${WORKER_ARGS:-}
# The workers' names (their sockets' stems): what Redis and /metrics call
# them. Unique per host when several hosts share one Redis (docs/scale-out.md).
export MOE_WORKER_NAME=${WORKER_NAME:-worker} MOE_FALLBACK_NAME=${FALLBACK_NAME:-fallback}
case "$MOE_WORKER_NAME$MOE_FALLBACK_NAME" in *[!A-Za-z0-9_.-]*)
  echo "supervise: WORKER_NAME and FALLBACK_NAME may hold only letters, digits, '_', '.' and '-'" >&2; exit 1 ;; esac
# One main worker per visible GPU (cuda: CUDA_VISIBLE_DEVICES' entries, else
# nvidia-smi's list), each with its own --device, budget (WORKER_ARGS applies
# to each), socket, name and profile; WORKERS sets the count (2 CPU workers,
# or 1 on a host of several GPUs). Worker 0 is WORKER_NAME, the others
# WORKER_NAME-1, WORKER_NAME-2, ... (docs/scale-out.md, "Several GPUs").
gpus=0
if [ "$BACKEND" = cuda ]; then
  if [ -n "${CUDA_VISIBLE_DEVICES+set}" ]; then
    gpus=$(tr ',' '\n' <<< "$CUDA_VISIBLE_DEVICES" | grep -c . || true)
  else
    gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
  fi
fi
if [ -z "${WORKERS:-}" ]; then
  WORKERS=1
  [ "${gpus:-0}" -ge 1 ] && WORKERS=$gpus
fi
case "$WORKERS" in ''|*[!0-9]*) echo "supervise: WORKERS must be a number from 1 to 16, not '$WORKERS'" >&2; exit 1 ;; esac
WORKERS=$((10#$WORKERS))
if [ "$WORKERS" -lt 1 ] || [ "$WORKERS" -gt 16 ]; then
  echo "supervise: WORKERS must be a number from 1 to 16, not '$WORKERS'" >&2; exit 1
fi
if [ "$BACKEND" = cuda ] && [ "$WORKERS" -gt 1 ] && [ "$WORKERS" -gt "${gpus:-0}" ]; then
  echo "supervise: WORKERS=$WORKERS CUDA workers, but $gpus GPU(s) are visible: one worker a GPU" >&2; exit 1
fi
# Each main worker keeps its expert use in a routing profile and starts from
# it after a restart (with Redis's last resident set first;
# docs/memory-islands.md): WARM_PROFILE is worker 0's file, FILE-1.json,
# FILE-2.json, ... the others' (FILE without its .json).
profile_args() {  # NAME INDEX
  [ "${WARM_PROFILE:-}" = off ] && return 0
  local profile=${WARM_PROFILE:-$state/$1.profile.json}
  if [ -n "${WARM_PROFILE:-}" ] && [ "$2" -gt 0 ]; then profile=${WARM_PROFILE%.json}-$2.json; fi
  case "$profile" in *[!A-Za-z0-9_./-]*)
    echo "supervise: WARM_PROFILE may hold only letters, digits, '_', '.', '/' and '-'" >&2; return 1 ;; esac
  echo "--save-profile $profile --warm-profile $profile"
}
# Several workers share the host: each gets its share of the cores for
# missed experts unless WORKER_ARGS says --threads.
THREAD_ARGS=""
if [ "$WORKERS" -gt 1 ] && [[ " ${WORKER_ARGS:-} " != *" --threads"* ]]; then
  THREAD_ARGS="--threads $(( $(nproc) / WORKERS > 0 ? $(nproc) / WORKERS : 1 ))"
fi
# The gateway's keys.
MOE_GATEWAY_ARGS=""
if [ -n "${API_KEY_FILE:-}" ]; then
  [ -r "$API_KEY_FILE" ] || { echo "supervise: cannot read API_KEY_FILE $API_KEY_FILE" >&2; exit 1; }
  MOE_GATEWAY_ARGS="--api-key-file $(cd "$(dirname "$API_KEY_FILE")" && pwd)/$(basename "$API_KEY_FILE")"
fi
if [ -n "${KEYS_FILE:-}" ]; then
  [ -r "$KEYS_FILE" ] || { echo "supervise: cannot read KEYS_FILE $KEYS_FILE" >&2; exit 1; }
  MOE_GATEWAY_ARGS="$MOE_GATEWAY_ARGS --keys-file $(cd "$(dirname "$KEYS_FILE")" && pwd)/$(basename "$KEYS_FILE")"
fi
[ -z "$MOE_GATEWAY_ARGS" ] && [ -z "${MOE_API_KEY:-}" ] &&
  echo "supervise: no API_KEY_FILE, KEYS_FILE or MOE_API_KEY: the API is open to whoever reaches $MOE_HOST:$MOE_PORT" >&2
# Overload goes to the fallback worker rather than waiting (docs/operations.md).
MOE_GATEWAY_ARGS="$MOE_GATEWAY_ARGS --overload-wait-ms ${OVERLOAD_WAIT_MS:-10000} --overload-queue-depth ${OVERLOAD_QUEUE_DEPTH:-0} ${GATEWAY_ARGS:-}"
export MOE_GATEWAY_ARGS
# Redis: its configuration in the state folder (0600), with the password if
# one is given; the workers and the gateway read the same file.
MOE_REDIS_AUTH_ARGS=""
redis_conf=$state/run/redis.conf
( umask 077
  { echo "port $MOE_REDIS_PORT"; echo "bind 127.0.0.1"; echo "dir $state/run"; echo "appendonly yes"
    if [ -n "${REDIS_PASSWORD_FILE:-}" ]; then
      pw=$(head -n 1 "$REDIS_PASSWORD_FILE")
      pw=${pw//\\/\\\\}; pw=${pw//\"/\\\"}
      echo "requirepass \"$pw\""
    fi; } > "$redis_conf" )
if [ -n "${REDIS_PASSWORD_FILE:-}" ]; then
  MOE_REDIS_AUTH_ARGS="--redis-password-file $(cd "$(dirname "$REDIS_PASSWORD_FILE")" && pwd)/$(basename "$REDIS_PASSWORD_FILE")"
fi
export MOE_REDIS_AUTH_ARGS
export MOE_BACKEND=$BACKEND
# supervisord's configuration: deploy/supervisord.conf, then a section a
# main worker (program worker, worker-1, ...; logs worker.log, worker-1.log, ...).
conf=$state/run/supervisord.conf
MOE_GATEWAY_WORKERS=""
{
  cat "$root/deploy/supervisord.conf"
  for ((i = 0; i < WORKERS; i++)); do
    program=worker name=$MOE_WORKER_NAME device=""
    if [ "$i" -gt 0 ]; then program=worker-$i name=$MOE_WORKER_NAME-$i; fi
    if [ "$BACKEND" = cuda ] && [ "$WORKERS" -gt 1 ]; then device="--device $i"; fi
    prof=$(profile_args "$name" "$i") || exit 1
    cat <<CONF

[program:$program]
command=/bin/sh -c 'exec %(ENV_MOE_WORKER_BIN)s --model %(ENV_MOE_MODEL)s --backend %(ENV_MOE_BACKEND)s --socket %(ENV_MOE_RUN_DIR)s/$name.sock --redis "%(ENV_MOE_REDIS_URL)s" \$MOE_REDIS_AUTH_ARGS $prof $device $THREAD_ARGS \$MOE_WORKER_ARGS'
priority=20
autorestart=true
startsecs=0
startretries=1000
stopsignal=TERM
stopwaitsecs=10
stdout_logfile=%(ENV_MOE_LOG_DIR)s/$program.log
redirect_stderr=true
CONF
  done
} > "$conf"
for ((i = 0; i < WORKERS; i++)); do
  name=$MOE_WORKER_NAME
  [ "$i" -gt 0 ] && name=$MOE_WORKER_NAME-$i
  MOE_GATEWAY_WORKERS="$MOE_GATEWAY_WORKERS --worker unix:$MOE_RUN_DIR/$name.sock"
done
export MOE_GATEWAY_WORKERS
echo "supervise: $MOE_MODEL on $MOE_BACKEND ($WORKERS worker$([ "$WORKERS" -gt 1 ] && echo s)), fallback" \
     "$MOE_FALLBACK_MODEL on cpu, http://$MOE_HOST:$MOE_PORT," \
     "Redis $MOE_REDIS_URL$([ "$MOE_REDIS_LOCAL" = true ] && echo ' (started here)'), logs in $MOE_LOG_DIR" >&2
exec "${supervisord_cmd[@]}" -n -c "$conf"
