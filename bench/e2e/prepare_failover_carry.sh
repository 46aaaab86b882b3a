#!/usr/bin/env bash
# Prepares what bench/e2e/failover_gpu.sh carries to a machine with nothing
# installed and no network: redis-server (+ redis-cli) with the shared
# libraries it needs beyond glibc, and supervisord as its Python package,
# packed as .device-build/failover-carry.tar.xz (or the path given).
#
# Usage: bench/e2e/prepare_failover_carry.sh [OUT.tar.xz]
#   run on a Debian/Ubuntu machine with apt (here: Debian 12); nothing is
#   installed, the .debs are fetched with `apt-get download` and unpacked
#   with `dpkg -x`.
#
# What is in it (failover-carry/):
#   bin/redis-server, bin/redis-cli  wrappers: LD_LIBRARY_PATH=lib, then the
#                                    carried binary
#   bin/supervisord, bin/supervisorctl
#                                    wrappers: python3 -m supervisor.* with
#                                    PYTHONPATH=python (and python-pkg when the
#                                    machine's python3 cannot import
#                                    pkg_resources itself); PYTHON=... picks
#                                    another interpreter
#   lib/                             the libraries of `ldd redis-server` that
#                                    are not glibc's, libstdc++ or libgcc
#                                    (libjemalloc, liblzf, libssl, libsystemd...)
#   python/supervisor                the supervisor package (pure Python)
#   python-pkg/pkg_resources         setuptools' pkg_resources: supervisor's
#                                    options.py imports it at start (Debian's
#                                    supervisor 4.2.5 depends on
#                                    python3-pkg-resources); its own _vendor
#                                    holds packaging, platformdirs and the rest
#   VERSIONS                         the packages' versions
# Checked here (CHECK_PYTHON picks the venv's interpreter): the carried supervisord starts a program and answers on its
# socket from a python3 venv without supervisor (bench/e2e/failover_gpu.sh
# --self-test does the same on the target).
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
out=${1:-$root/.device-build/failover-carry.tar.xz}
case $out in /*) ;; *) out=$(pwd)/$out ;; esac
work=$(mktemp -d /tmp/failover-carry-XXXXXX)
trap 'rm -rf "$work"' EXIT
carry=$work/failover-carry
mkdir -p "$work/debs" "$work/x" "$carry/bin" "$carry/lib" "$carry/python" "$carry/python-pkg"

# The packages: the programs, pkg_resources, and the packages of every
# library redis-server links beyond the C and C++ runtimes.
redis_bin=$(command -v redis-server || true)
pkgs="redis-server redis-tools supervisor python3-pkg-resources"
libpkgs=""
if [ -n "$redis_bin" ]; then
  for lib in $(ldd "$redis_bin" | awk '/=>/ {print $3}'); do
    case $(basename "$lib") in libc.so*|libm.so*|libpthread*|libdl.so*|librt.so*|ld-linux*|libstdc++*|libgcc_s*) continue ;; esac
    p=$(dpkg -S "$(readlink -f "$lib")" 2>/dev/null | head -n1 | cut -d: -f1) ||
      p=$(dpkg -S "$lib" 2>/dev/null | head -n1 | cut -d: -f1) || true
    [ -n "$p" ] && libpkgs="$libpkgs $p"
  done
else
  # No redis-server here to ask: the libraries of Debian 12's redis-tools.
  libpkgs="libjemalloc2 liblzf1 libatomic1 libssl3 libsystemd0 libcap2 libgcrypt20 liblzma5 libzstd1 liblz4-1 libgpg-error0"
fi
libpkgs=$(echo "$libpkgs" | tr ' ' '\n' | sed '/^$/d' | sort -u | tr '\n' ' ')
echo "prepare: packages $pkgs $libpkgs" >&2
(cd "$work/debs" && apt-get download $pkgs $libpkgs 2>&1 | grep -v "^W: Download is performed unsandboxed" >&2)
for d in "$work"/debs/*.deb; do dpkg -x "$d" "$work/x"; done
: > "$carry/VERSIONS"
for d in "$work"/debs/*.deb; do dpkg-deb -f "$d" Package Version | paste -sd' ' >> "$carry/VERSIONS"; done

# redis-server is a link to redis-check-rdb (redis-tools): keep the real file.
cp -L "$work/x/usr/bin/redis-server" "$carry/lib/redis-server"
cp -L "$work/x/usr/bin/redis-cli" "$carry/lib/redis-cli"
for dir in "$work/x/usr/lib/x86_64-linux-gnu" "$work/x/lib/x86_64-linux-gnu"; do
  [ -d "$dir" ] && find "$dir" -maxdepth 1 -name '*.so*' -exec cp -a {} "$carry/lib/" \;
done
cp -a "$work/x/usr/lib/python3/dist-packages/supervisor" "$carry/python/"
cp -a "$work/x/usr/lib/python3/dist-packages/pkg_resources" "$carry/python-pkg/"
find "$carry/python" "$carry/python-pkg" -name __pycache__ -prune -exec rm -rf {} +

for prog in redis-server redis-cli; do
  cat > "$carry/bin/$prog" <<EOF
#!/bin/sh
# The carried $prog with its libraries (bench/e2e/prepare_failover_carry.sh).
d=\$(cd "\$(dirname "\$0")/.." && pwd)
LD_LIBRARY_PATH=\$d/lib\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH} exec "\$d/lib/$prog" "\$@"
EOF
done
for prog in supervisord supervisorctl; do
  cat > "$carry/bin/$prog" <<EOF
#!/bin/sh
# The carried $prog: the supervisor package on PYTHONPATH, and pkg_resources
# too when this python3 has none (bench/e2e/prepare_failover_carry.sh).
d=\$(cd "\$(dirname "\$0")/.." && pwd)
py=\${PYTHON:-python3}
pp=\$d/python
"\$py" -c 'import pkg_resources' >/dev/null 2>&1 || pp=\$pp:\$d/python-pkg
PYTHONPATH=\$pp\${PYTHONPATH:+:\$PYTHONPATH} exec "\$py" -m supervisor.$prog "\$@"
EOF
done
chmod +x "$carry"/bin/*

# Check it here: redis-server answers, and supervisord from a venv without
# supervisor runs a program and answers supervisorctl.
"$carry/bin/redis-server" --version >&2
# CHECK_PYTHON: the interpreter of the check's venv (default the first of
# python3.12, python3 that runs); the target machine's is 3.12.
py=""
for c in ${CHECK_PYTHON:-} python3.12 python3; do
  if "$c" -c 'import venv' >/dev/null 2>&1; then py=$c; break; fi
done
"$py" -m venv "$work/venv"
if "$work/venv/bin/python" -c 'import supervisor' 2>/dev/null; then echo "prepare: the venv has supervisor already?" >&2; exit 1; fi
cat > "$work/check.conf" <<EOF
[supervisord]
nodaemon=true
logfile=$work/sd.log
pidfile=$work/sd.pid
[unix_http_server]
file=$work/sd.sock
[rpcinterface:supervisor]
supervisor.rpcinterface_factory = supervisor.rpcinterface:make_main_rpcinterface
[supervisorctl]
serverurl=unix://$work/sd.sock
[program:redis]
command=$carry/bin/redis-server --port 0 --unixsocket $work/r.sock --save ""
startsecs=1
EOF
PYTHON=$work/venv/bin/python "$carry/bin/supervisord" -c "$work/check.conf" &
sd=$!
ok=0
for _ in $(seq 1 100); do
  if PYTHON=$work/venv/bin/python "$carry/bin/supervisorctl" -c "$work/check.conf" status redis 2>/dev/null | grep -q RUNNING &&
     [ "$("$carry/bin/redis-cli" -s "$work/r.sock" PING 2>/dev/null)" = PONG ]; then ok=1; break; fi
  sleep 0.1
done
kill "$sd"; wait "$sd" || true
[ $ok = 1 ] || { echo "prepare: the carried supervisord did not run the carried redis-server ($("$work/venv/bin/python" --version))" >&2; cat "$work/sd.log" >&2; exit 1; }
echo "prepare: checked with $("$work/venv/bin/python" --version) (a venv without supervisor): supervisord ran redis-server" >&2

mkdir -p "$(dirname "$out")"
tar -C "$work" -cJf "$out" failover-carry
echo "prepare: wrote $out ($(du -h "$out" | cut -f1)); contents:" >&2
cat "$carry/VERSIONS" >&2
