#!/usr/bin/env bash
# Prints ON or OFF: whether setup_venv.sh and dev_build.sh build the CUDA kernels.
#   bash scripts/cuda_choice.sh [VENV]
# PAGEDD_CUDA=ON or OFF decides, and is remembered in VENV/.pagedd-cuda so that later runs
# without the variable keep it. Unset: the remembered choice, else as AUTO. AUTO: ON only when
# nvcc is found and an NVIDIA driver is present (a GPU that can run the kernels); compiling
# them takes several minutes, for nothing on a machine without a GPU.
set -euo pipefail
venv=${1:-.venv}
remembered="$venv/.pagedd-cuda"
choice=${PAGEDD_CUDA:-}
if [ -z "$choice" ] && [ -f "$remembered" ]; then
  cat "$remembered"
  exit 0
fi
case "${choice:-AUTO}" in
  ON | OFF) ;;
  AUTO)
    if command -v nvcc >/dev/null && { [ -e /proc/driver/nvidia/version ] || nvidia-smi -L >/dev/null 2>&1; }; then
      choice=ON
    else
      choice=OFF
    fi
    ;;
  *)
    echo "PAGEDD_CUDA must be AUTO, ON or OFF (got $choice)" >&2
    exit 2
    ;;
esac
if [ -d "$venv" ]; then
  echo "$choice" > "$remembered"
fi
echo "$choice"
