#!/usr/bin/env bash
# Every test: set up, build, run the whole suite (CTest); then a clang build
# with AddressSanitizer + UBSan and the libFuzzer targets (build-asan), each
# fuzzer for a bounded time from the seeds in the tree, and the gateway's,
# the protocol's and the attack test again on that build (docs/security.md).
set -euo pipefail
cd "$(dirname "$0")/.."
MOE_EXTRA_PACKAGES="clang libclang-rt-14-dev chromium" deploy/setup.sh build
(cd build && ctest --output-on-failure -j "$(nproc)" --timeout 900)

echo "== the sanitized build (clang, ASan + UBSan, libFuzzer)"
CC=clang CXX=clang++ cmake -S . -B build-asan -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DMOE_SANITIZE=ON -DMOE_FUZZ=ON -DMOE_CUDA=OFF >/dev/null
cmake --build build-asan -j "$(nproc)" --target moe_protocol_tests moe_gateway_tests moe_scheduler_tests moe_structured_tests \
  moe_prediction_tests moe-gateway moe-worker moe_protocol_fuzz moe_http_fuzz moe_chat_template_fuzz moe_gguf_fuzz

echo "== fuzzing, ${MOE_FUZZ_SECONDS:-30} s a target"
deploy/fuzz.sh build-asan "${MOE_FUZZ_SECONDS:-30}"

echo "== the gateway's, the protocol's and the attack test under ASan + UBSan"
(cd build-asan && ctest --output-on-failure --timeout 900 -L "protocol|gateway" &&
  ctest --output-on-failure --timeout 900 -R integration_attack_test)
