#!/usr/bin/env bash
# llama.cpp's source, trimmed to what bench/e2e/device_run.sh builds on the GPU
# machine (llama-server and llama-quantize with CUDA) and runs
# (convert_hf_to_gguf.py --vocab-only, gguf-py): ~3.7 MB as .tar.xz.
#   bench/e2e/prepare_llama_source.sh SRC [OUT]
# SRC: a llama.cpp source tree (e.g. `git archive` of a snapshot); OUT
# (default .device-build/llama-src.tar.xz) holds one top folder, llama.cpp/,
# and UPSTREAM_COMMIT when SRC is a git checkout. The other backends, docs,
# media, CI files, benches and the web UI's sources are left out; the web UI
# then builds without its assets (-DLLAMA_USE_PREBUILT_UI=OFF on the GPU
# machine, which cannot download them).
set -euo pipefail
src=$(cd "$1" && pwd)
out=${2:-.device-build/llama-src.tar.xz}
mkdir -p "$(dirname "$out")"
out=$(cd "$(dirname "$out")" && pwd)/$(basename "$out")
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
mkdir "$tmp/llama.cpp"
(cd "$src" && tar cf - --exclude=.git .) | tar xf - -C "$tmp/llama.cpp"
cd "$tmp/llama.cpp"
rm -rf .devops .gemini .github .pi benches build-xcframework.sh ci docs flake.nix media skills \
  tools/mtmd/test-3.mp4 tools/mtmd/tests tools/server/bench tools/server/tests
for b in cann et hexagon hip metal musa opencl openvino sycl virtgpu vulkan webgpu zdnn zendnn kompute; do
  rm -rf "ggml/src/ggml-$b"
done
# The web UI: its CMake parts only (CMakeLists.txt, embed.cpp, sources.cmake).
if [ -d tools/ui ]; then
  find tools/ui -mindepth 1 -maxdepth 1 ! -name CMakeLists.txt ! -name embed.cpp ! -name sources.cmake -exec rm -rf {} +
fi
if git -C "$src" rev-parse HEAD >/dev/null 2>&1; then
  echo "upstream $(git -C "$src" rev-parse HEAD) ($(git -C "$src" log -1 --format=%cs))" >UPSTREAM_COMMIT
fi
cd "$tmp"
tar cJf "$out" llama.cpp
echo "prepare_llama_source: $out, $(du -h "$out" | cut -f1)"
