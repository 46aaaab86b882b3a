#!/usr/bin/env bash
# The main job: set up, build, and serve at http://127.0.0.1:8080 (override
# with HOST / PORT).
#   deploy/run.sh [MODEL] [moe-gateway options...]
# MODEL: a checkpoint folder, a GGUF file or a packed model file (default: the embedded demo
# model). The gateway's own worker runs on the GPU when this build has CUDA
# and a device is visible, else on the CPU; its log says which and why.
set -euo pipefail
cd "$(dirname "$0")/.."
model=models/demo-moe
if [ $# -gt 0 ] && [ "${1#-}" = "$1" ]; then
  model=$1
  shift
fi
if [ ! -e "$model" ]; then
  echo "run.sh: no model at '$model' (a checkpoint folder, a GGUF file or a packed model file)" >&2
  exit 2
fi
deploy/setup.sh build
exec build/gateway/moe-gateway --model "$model" --host "${HOST:-127.0.0.1}" --port "${PORT:-8080}" "$@"
