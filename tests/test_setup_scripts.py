"""`scripts/cuda_choice.sh` (issue 32, finding 9): on a machine with nvcc but no GPU driver the
quick start builds no CUDA kernels (they took 11 minutes for nothing), and PAGEDD_CUDA=OFF
or ON sticks across later runs of the scripts."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _choice(venv: Path, bin_dir: Path, cuda: str | None = None) -> str:
    env = {k: v for k, v in os.environ.items() if k != "PAGEDD_CUDA"}
    env["PATH"] = f"{bin_dir}:/usr/bin:/bin"
    if cuda is not None:
        env["PAGEDD_CUDA"] = cuda
    out = subprocess.run(
        ["bash", str(ROOT / "scripts" / "cuda_choice.sh"), str(venv)],
        env=env, capture_output=True, text=True, check=True,
    )  # fmt: skip
    return out.stdout.strip()


def _tool(bin_dir: Path, name: str, rc: int = 0) -> None:
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / name).write_text(f"#!/bin/sh\nexit {rc}\n")
    (bin_dir / name).chmod(0o755)


@pytest.mark.skipif(Path("/proc/driver/nvidia/version").exists(), reason="a GPU driver is here")
def test_auto_builds_cuda_only_with_a_driver(tmp_path):
    bin_dir, venv = tmp_path / "bin", tmp_path / "venv"
    _tool(bin_dir, "nvcc")
    assert _choice(venv, bin_dir) == "OFF"  # nvcc, no driver: nothing could run the kernels
    _tool(bin_dir, "nvidia-smi")
    assert _choice(venv, bin_dir, "AUTO") == "ON"


def test_an_explicit_choice_sticks(tmp_path):
    bin_dir, venv = tmp_path / "bin", tmp_path / "venv"
    venv.mkdir()
    _tool(bin_dir, "nvcc")
    _tool(bin_dir, "nvidia-smi")
    assert _choice(venv, bin_dir, "OFF") == "OFF"
    assert _choice(venv, bin_dir) == "OFF"  # a later run without the variable keeps it
    assert _choice(venv, bin_dir, "ON") == "ON"
    assert _choice(venv, bin_dir) == "ON"
