#!/usr/bin/env bash
# Build pydaemon._core in place (next to the Python sources) without pip, for quick loops:
#   PAGEDD_CUDA=OFF scripts/dev_build.sh        (PYTHON=/path/to/python to pick another one)
# The Python it builds for (and whose nanobind it uses) is .venv's, activated or not, else the
# one on PATH.
# Then `PYTHONPATH=. python -m pytest`. The installed route is `pip install --no-build-isolation -ve .`.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
if [ -z "${PYTHON:-}" ]; then
  if [ -x "$VENV/bin/python" ]; then PYTHON=$VENV/bin/python; else PYTHON=python3; fi
fi
if ! "$PYTHON" -c "import nanobind" 2>/dev/null; then
  echo "dev_build.sh: $PYTHON has no nanobind: run scripts/setup_venv.sh first, or set PYTHON" >&2
  exit 1
fi
BUILD=${BUILD:-build/dev}
cmake -S . -B "$BUILD" -G Ninja -DPAGEDD_BUILD_PYTHON=ON -DCMAKE_BUILD_TYPE=${BUILD_TYPE:-Release} \
  -DPython_EXECUTABLE="$("$PYTHON" -c 'import sys; print(sys.executable)')" \
  -DPAGEDD_CUDA="$(bash scripts/cuda_choice.sh "$VENV")" ${CMAKE_ARGS:-} >/dev/null
cmake --build "$BUILD"
cp "$BUILD"/cpp/bindings/_core*.so pydaemon/
cp "$BUILD"/cpp/bindings/_core.pyi pydaemon/ 2>/dev/null || true
echo "built $(ls pydaemon/_core*.so)"
