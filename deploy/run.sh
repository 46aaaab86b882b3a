#!/usr/bin/env bash
# The main job: set up, build, and serve the embedded demo model on the CPU
# at http://127.0.0.1:8080 (override with HOST / PORT).
set -euo pipefail
cd "$(dirname "$0")/.."
deploy/setup.sh build
exec build/gateway/moe-gateway --model models/demo-moe --host "${HOST:-127.0.0.1}" --port "${PORT:-8080}" "$@"
