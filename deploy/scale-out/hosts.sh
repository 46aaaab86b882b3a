#!/usr/bin/env bash
# Several moe-serve hosts on one machine, each in a network namespace of its
# own (its own address, its gateway and a CPU worker on the demo model), one
# Redis they all share, and nginx in front with
# deploy/scale-out/nginx.conf: the test topology of docs/scale-out.md, and a
# picture of a real one (there each host is a machine).
#
#   deploy/scale-out/hosts.sh start N     N hosts, Redis, nginx; waits until every host is healthy
#   deploy/scale-out/hosts.sh kill I      kill -9 every process of host I (1..N)
#   deploy/scale-out/hosts.sh revive I    start host I again
#   deploy/scale-out/hosts.sh stop        everything, namespaces and links removed
#   deploy/scale-out/hosts.sh status      each host's health through its own address
#
# Needs root (ip netns, a bridge), nginx, redis-server, a build (BUILD_DIR).
# Env: BUILD_DIR (build), MODEL (the demo model), STATE_DIR
#      (/tmp/moe-scale-out), NET (10.231.0: hosts are NET.11, NET.12, …,
#      Redis and nginx's side NET.1), PORT (nginx on 127.0.0.1:PORT, 8090),
#      REDIS_PORT (6391), NAME (moe: names the namespaces NAME-h1…, the
#      bridge NAME-br and the links NAME-v1…), GATEWAY_ARGS (more moe-gateway
#      options for every host, words split).
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
build=${BUILD_DIR:-build}
case $build in /*) ;; *) build=$root/$build ;; esac
model=${MODEL:-$root/models/demo-moe}
state=${STATE_DIR:-/tmp/moe-scale-out}
net=${NET:-10.231.0}
port=${PORT:-8090}
redis_port=${REDIS_PORT:-6391}
name=${NAME:-moe}
bridge=$name-br

say() { echo "scale-out: $*" >&2; }
die() { say "$*"; exit 1; }
host_ns() { echo "$name-h$1"; }
host_addr() { echo "$net.$((10 + $1))"; }
healthy() { curl -s -m 2 -o /dev/null -w '%{http_code}' "http://$1/health" 2>/dev/null | grep -q 200; }
# A host takes traffic once its worker said hello and its gateway reaches
# Redis: before that, a session's turn would live in that gateway's memory
# alone (lost with the host).
host_ready() { curl -sf -m 2 "http://$1/health" 2>/dev/null | grep -Eq '"redis": ?"connected"'; }

start_host() {
  local i=$1 ns addr
  ns=$(host_ns "$i")
  addr=$(host_addr "$i")
  if ! ip netns list | grep -w "$ns" >/dev/null; then
    ip netns add "$ns"
    ip link add "$name-v$i" type veth peer name eth0 netns "$ns"
    ip link set "$name-v$i" master "$bridge" up
    ip -n "$ns" addr add "$addr/24" dev eth0
    ip -n "$ns" link set eth0 up
    ip -n "$ns" link set lo up
  fi
  # The host's CPU worker and its gateway, both in the namespace (the
  # worker's socket is a file: namespaces do not hide it). The socket's
  # name is the worker's name in Redis: one per host, as on real hosts.
  local sock="$state/run/h$i-worker.sock"
  rm -f "$sock"
  ip netns exec "$ns" setsid "$build/worker/moe-worker" --model "$model" --socket "$sock" --backend cpu \
    --threads 1 --redis "redis://$net.1:$redis_port" >>"$state/logs/h$i-worker.log" 2>&1 </dev/null &
  for _ in $(seq 1 300); do [ -S "$sock" ] && break; sleep 0.05; done
  # shellcheck disable=SC2086
  ip netns exec "$ns" setsid "$build/gateway/moe-gateway" --model "$model" --host "$addr" --port 8080 \
    --worker "unix:$sock" --redis "redis://$net.1:$redis_port" --trusted-proxy "$net.1" ${GATEWAY_ARGS:-} \
    >>"$state/logs/h$i.log" 2>&1 </dev/null &
}

wait_host() {
  local i=$1 addr
  addr=$(host_addr "$i")
  for _ in $(seq 1 600); do
    host_ready "$addr:8080" && return 0
    sleep 0.1
  done
  tail -20 "$state/logs/h$i.log" >&2
  say "host $i ($addr) never became healthy with Redis connected"
  return 1
}

kill_host() {
  local ns
  ns=$(host_ns "$1")
  ip netns list | grep -w "$ns" >/dev/null || die "no host $1"
  local pids
  pids=$(ip netns pids "$ns" 2>/dev/null || true)
  [ -n "$pids" ] && kill -9 $pids 2>/dev/null || true
}

start() {
  local n=$1
  [ "$(id -u)" = 0 ] || die "needs root (network namespaces)"
  command -v nginx >/dev/null || die "nginx is not installed (apt-get install nginx-light)"
  command -v redis-server >/dev/null || die "redis-server is not installed"
  [ -x "$build/gateway/moe-gateway" ] && [ -x "$build/worker/moe-worker" ] ||
    die "no $build/gateway/moe-gateway or $build/worker/moe-worker (build first, or give BUILD_DIR)"
  [ -f "$state/run/hosts" ] && die "already running ($state); stop it first"
  mkdir -p "$state/run" "$state/logs" "$state/nginx/logs" "$state/nginx/conf" "$state/redis"
  echo "$n" >"$state/run/hosts"
  # Whatever fails from here leaves nothing behind.
  trap 'say "start failed; stopping what started"; stop' ERR
  ip link add "$bridge" type bridge
  ip addr add "$net.1/24" dev "$bridge"
  ip link set "$bridge" up
  redis-server --port "$redis_port" --bind "$net.1" 127.0.0.1 --dir "$state/redis" --save "" --appendonly no \
    --daemonize no --protected-mode no >"$state/logs/redis.log" 2>&1 </dev/null &
  echo $! >"$state/run/redis.pid"
  for _ in $(seq 1 100); do
    redis-cli -p "$redis_port" ping 2>/dev/null | grep -q PONG && break
    sleep 0.05
  done
  for i in $(seq 1 "$n"); do start_host "$i"; done
  for i in $(seq 1 "$n"); do wait_host "$i" || { stop; exit 1; }; done
  # nginx with the project's configuration, the hosts and the port filled
  # in, its files under the state folder.
  local servers=""
  for i in $(seq 1 "$n"); do servers+="    server $(host_addr "$i"):8080 max_fails=1 fail_timeout=10s;\n"; done
  awk -v servers="$servers" -v listen="    listen 127.0.0.1:$port;" -v tmp="$state/nginx" '
    /# hosts:/ { print; printf "%s", servers; skip = 1; next }
    /# end of hosts/ { skip = 0 }
    skip { next }
    /^ *listen / { print listen; next }
    /^http \{/ { print; print "  client_body_temp_path " tmp "/body; proxy_temp_path " tmp "/proxy;";
                 print "  fastcgi_temp_path " tmp "/fastcgi; uwsgi_temp_path " tmp "/uwsgi; scgi_temp_path " tmp "/scgi;"; next }
    { print }' "$root/deploy/scale-out/nginx.conf" >"$state/nginx/conf/nginx.conf"
  nginx -p "$state/nginx" -c conf/nginx.conf -g "pid $state/nginx/nginx.pid; daemon off;" \
    >>"$state/logs/nginx.log" 2>&1 </dev/null &
  echo $! >"$state/run/nginx.pid"
  for _ in $(seq 1 100); do
    healthy "127.0.0.1:$port" && break
    sleep 0.1
  done
  healthy "127.0.0.1:$port" || { cat "$state/logs/nginx.log" >&2; stop; die "nginx does not answer on 127.0.0.1:$port"; }
  trap - ERR
  say "$n hosts ($(host_addr 1) … $(host_addr "$n")), Redis on $net.1:$redis_port, nginx on http://127.0.0.1:$port"
}

stop() {
  local n=0
  [ -f "$state/run/hosts" ] && n=$(cat "$state/run/hosts")
  for i in $(seq 1 "$n"); do
    if ip netns list | grep -w "$(host_ns "$i")" >/dev/null; then
      kill_host "$i" || true
      ip netns del "$(host_ns "$i")" 2>/dev/null || true
    fi
  done
  for p in nginx redis; do
    [ -f "$state/run/$p.pid" ] && kill "$(cat "$state/run/$p.pid")" 2>/dev/null || true
  done
  sleep 0.2
  for p in nginx redis; do
    [ -f "$state/run/$p.pid" ] && kill -9 "$(cat "$state/run/$p.pid")" 2>/dev/null || true
    rm -f "$state/run/$p.pid"
  done
  ip link del "$bridge" 2>/dev/null || true
  rm -f "$state/run/hosts"
}

status() {
  local n
  n=$(cat "$state/run/hosts" 2>/dev/null || echo 0)
  for i in $(seq 1 "$n"); do
    if healthy "$(host_addr "$i"):8080"; then echo "host $i $(host_addr "$i") up"; else echo "host $i $(host_addr "$i") down"; fi
  done
}

case ${1:-} in
  start) start "${2:?how many hosts}" ;;
  kill) kill_host "${2:?which host}" ;;
  revive)
    [ -f "$state/run/hosts" ] || die "not running ($state)"
    [ -z "$(ip netns pids "$(host_ns "${2:?which host}")" 2>/dev/null)" ] || die "host $2 still runs; kill it first"
    start_host "$2"
    wait_host "$2" ;;
  stop) stop ;;
  status) status ;;
  *) sed -n '2,20p' "$0" | sed 's/^# \{0,1\}//'; exit 2 ;;
esac
