#!/usr/bin/env bash
# Build pydaemon._core in place (next to the Python sources) without pip, for quick loops:
#   PYTHON=/path/to/python PAGEDD_CUDA=OFF scripts/dev_build.sh
# Then `PYTHONPATH=. python -m pytest`. The installed route is `pip install --no-build-isolation -ve .`.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
BUILD=${BUILD:-build/dev}
cmake -S . -B "$BUILD" -G Ninja -DPAGEDD_BUILD_PYTHON=ON -DCMAKE_BUILD_TYPE=${BUILD_TYPE:-Release} \
  -DPython_EXECUTABLE="$("$PYTHON" -c 'import sys; print(sys.executable)')" \
  -DPAGEDD_CUDA="$(bash scripts/cuda_choice.sh "${VENV:-.venv}")" ${CMAKE_ARGS:-} >/dev/null
cmake --build "$BUILD"
cp "$BUILD"/cpp/bindings/_core*.so pydaemon/
cp "$BUILD"/cpp/bindings/_core.pyi pydaemon/ 2>/dev/null || true
echo "built $(ls pydaemon/_core*.so)"
