#!/usr/bin/env bash
# Build the C++ block-manager tests with AddressSanitizer + UBSan (no Python, no CUDA) and
# run them through ctest:  bash scripts/test_cpp_sanitized.sh
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${BUILD:-build/asan}
GEN=()
command -v ninja >/dev/null && GEN=(-G Ninja)
cmake -S . -B "$BUILD" "${GEN[@]}" -DCMAKE_BUILD_TYPE=Debug -DPAGEDD_BUILD_TESTS=ON \
  -DPAGEDD_SANITIZE=ON -DPAGEDD_CUDA=OFF >/dev/null
cmake --build "$BUILD"
ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=0} \
UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1} \
  ctest --test-dir "$BUILD" --output-on-failure
