#!/usr/bin/env bash
# Every test: set up, build, run the whole suite (CTest), then the protocol
# tests again under AddressSanitizer + UBSan.
set -euo pipefail
cd "$(dirname "$0")/.."
deploy/setup.sh build
(cd build && ctest --output-on-failure -j "$(nproc)" --timeout 900)

echo "== protocol tests under AddressSanitizer"
cmake -S . -B build-asan -G Ninja -DCMAKE_BUILD_TYPE=Debug -DMOE_SANITIZE=ON -DMOE_CUDA=OFF >/dev/null
cmake --build build-asan -j "$(nproc)" --target moe_protocol_tests
(cd build-asan && ctest --output-on-failure -L protocol)
