"""The Triton fused-MoE expert path (pydaemon/layers/moe/triton_moe.py) without a GPU: its
kernels under Triton's interpreter (tests/moe_triton_interpreted.py, run in a pytest
subprocess with TRITON_INTERPRET=1: the switch must be set before triton is first imported),
the tile table, the CPU refusing the path, and importing pydaemon without importing triton.
The interpreter cases skip where triton is not installed (it comes with xgrammar on Linux
x86-64, so CI has it)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pydaemon.layers.moe import triton_moe

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")
def test_the_kernels_under_the_triton_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
           str(ROOT / "tests" / "moe_triton_interpreted.py")]  # fmt: skip
    out = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=900)
    report = out.stdout[-8000:] + out.stderr[-2000:]
    assert out.returncode == 0, report
    summary = out.stdout.strip().splitlines()[-1]
    assert " passed" in summary and "skipped" not in summary, report


def test_supports_needs_cuda_and_half_precision():
    w = torch.zeros(2, 4, 4, dtype=torch.bfloat16)
    assert not triton_moe.supports(torch.zeros(1, 4, dtype=torch.bfloat16), w, w)  # the CPU


def test_tile_config_by_tokens():
    assert triton_moe.tile_config(1).block_m == 16
    assert triton_moe.tile_config(64).block_m == 16
    assert triton_moe.tile_config(4096).block_m >= 64
    bounds = [b for b, _ in triton_moe.TILE_CONFIGS]
    assert bounds == sorted(bounds)


def test_max_padded_rows_bounds_the_padding():
    # every expert that has a slot pads at most block_m - 1 rows; at most min(E, S) have one
    assert triton_moe.max_padded_rows(8, 128, 16) == 8 + 8 * 15
    assert triton_moe.max_padded_rows(512, 128, 16) == 512 + 128 * 15


def test_importing_pydaemon_does_not_import_triton():
    code = (
        "import sys\n"
        "import pydaemon.layers.moe.experts, pydaemon.layers.moe.triton_moe, pydaemon.models\n"
        "print('triton' in sys.modules)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
