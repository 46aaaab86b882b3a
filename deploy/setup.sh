#!/usr/bin/env bash
# Installs the Debian 12 packages the project needs and builds it.
# Usage: deploy/setup.sh [BUILD_DIR]   (default: build). Run as root on a
# fresh machine; later runs skip what is already installed.
# MOE_EXTRA_PACKAGES names more Debian packages (deploy/test.sh: clang and
# its sanitizer runtimes).
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${1:-build}

PACKAGES=(build-essential cmake ninja-build pkg-config ccache git
          libuv1-dev libflatbuffers-dev flatbuffers-compiler libhiredis-dev
          catch2 nlohmann-json3-dev libpcre2-dev libutf8proc-dev
          redis-server supervisor curl python3 nginx iproute2 ${MOE_EXTRA_PACKAGES:-})
missing=()
for p in "${PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed" || missing+=("$p")
done
# Node.js (for the tests that drive the server through the official openai
# package) only when no node is on the PATH already.
command -v node >/dev/null 2>&1 || missing+=(nodejs npm)
if ((${#missing[@]})); then
  echo "setup: installing ${missing[*]}" >&2
  if [ "$(id -u)" != 0 ]; then echo "setup: run as root to install packages" >&2; exit 1; fi
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

JOBS=$(nproc)
cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo ${MOE_CMAKE_ARGS:-} >/dev/null
cmake --build "$BUILD_DIR" -j "$JOBS"
