#!/usr/bin/env bash
# The wheels the GPU machine's image lacks (it reaches no package index), into .whl/base
# (git-ignored), for scripts/gpu_gate.sh to install there: carry `.whl` in the device call.
#   bash scripts/fetch_gpu_wheels.sh            (PY_VERSION overrides 3.12)
# grpcio-* at 1.84.0: the image's grpcio. Ray travels apart (scripts/fetch_ray_wheels.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
PY_VERSION=${PY_VERSION:-3.12}
rm -rf .whl/base && mkdir -p .whl/base
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$PY_VERSION" \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl/base \
  "gguf==0.19.0" "msgspec==0.23.0" "pydantic==2.14.4" "pydantic_core==2.50.5" \
  "annotated-types==0.8.0" "typing-inspection==0.4.5" "xgrammar==0.2.9" \
  "apache-tvm-ffi==0.1.15.post2" "jsonschema==4.26.0" "jsonschema-specifications==2025.9.1" \
  "referencing==0.37.0" "rpds-py==2026.9.1" "grpcio-health-checking==1.84.0" \
  "grpcio-reflection==1.84.0"
du -sh .whl/base
ls .whl/base
