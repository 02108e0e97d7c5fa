#!/usr/bin/env bash
# Create .venv (once) and install pagedd into it with its test extra; the command is then
# .venv/bin/pagedd (`source .venv/bin/activate` puts it on PATH). Idempotent: the C++ core
# is rebuilt only when cpp/, CMakeLists.txt or pyproject.toml changed since the last install.
#   PAGEDD_TORCH   torch requirement to install first (default torch==2.13.0)
#   PAGEDD_CUDA    AUTO | ON | OFF: build the CUDA kernels (AUTO: when nvcc is found)
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
stamp_now=$( (echo "PAGEDD_CUDA=${PAGEDD_CUDA:-AUTO}"; cat pyproject.toml CMakeLists.txt $(find cpp -type f | sort)) | sha1sum | cut -c1-16)
stamp_file="$VENV/.pagedd-build-stamp"
if [ "$(cat "$stamp_file" 2>/dev/null)" != "$stamp_now" ] || ! "$PY" -c "import pydaemon._core" 2>/dev/null; then
  cuda=${PAGEDD_CUDA:-AUTO}
  if [ "$cuda" = OFF ] || { [ "$cuda" = AUTO ] && ! command -v nvcc >/dev/null; }; then
    echo "== building pagedd: the C++ core without CUDA kernels (PAGEDD_CUDA=$cuda; about a minute)"
  else
    echo "== building pagedd: the C++ core and the CUDA kernels with $(command -v nvcc || echo nvcc)"
    echo "   (PAGEDD_CUDA=$cuda). The kernels take several minutes to compile and print nothing"
    echo "   meanwhile. On a machine without a GPU, PAGEDD_CUDA=OFF skips them."
    command -v nvidia-smi >/dev/null || echo "   note: no nvidia-smi here: no GPU will use these kernels"
  fi
  start=$(date +%s)
  "$PY" -m pip install -q --no-build-isolation -e ".[test]"
  echo "$stamp_now" > "$stamp_file"
  echo "== built and installed in $(( $(date +%s) - start )) s: $VENV/bin/pagedd"
fi
