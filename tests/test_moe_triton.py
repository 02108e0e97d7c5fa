"""The Triton fused-MoE expert path (pydaemon/layers/moe/triton_moe.py) without a GPU: its
kernels under Triton's interpreter (tests/moe_triton_interpreted.py, run in a pytest
subprocess with TRITON_INTERPRET=1: the switch must be set before triton is first imported),
the kernels compiled ahead of time for sm_90 (Hopper: Triton's compiler and its bundled
ptxas need no GPU) with every tile config of the table, within the H100/H200's shared memory
and with the loads pipelined (cp.async) and the products on tensor cores, the tile table, the CPU
refusing the path, and importing pydaemon without importing triton. The triton cases skip
where triton is not installed (it comes with xgrammar on Linux x86-64, so CI has it)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from triton_sm90 import HOPPER_SHARED_MEMORY, compile_sm90

from pydaemon.layers.moe import triton_moe

ROOT = Path(__file__).resolve().parents[1]
needs_triton = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="triton not installed"
)


@needs_triton
def test_the_kernels_under_the_triton_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
           str(ROOT / "tests" / "moe_triton_interpreted.py")]  # fmt: skip
    out = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=900)
    report = out.stdout[-8000:] + out.stderr[-2000:]
    assert out.returncode == 0, report
    summary = out.stdout.strip().splitlines()[-1]
    assert " passed" in summary and "skipped" not in summary, report


_GEMM_SIGNATURE = {
    "a_ptr": "*bf16", "w_ptr": "*bf16", "c_ptr": "*bf16", "sorted_slots_ptr": "*i32",
    "block_expert_ptr": "*i32", "weight_ptr": "*fp32", "N": "i32", "K": "i32",
    "num_slots": "i32", "max_blocks": "i32", "stride_am": "i32", "stride_we": "i32",
    "stride_wn": "i32", "stride_wk": "i32", "stride_cm": "i32",
}  # fmt: skip


@needs_triton
@pytest.mark.parametrize("index", range(len(triton_moe.TILE_CONFIGS)))
@pytest.mark.parametrize("n,k,row_div,mul_weight", [(1536, 2048, 8, False), (2048, 768, 1, True)],
                         ids=["gate_up", "down"])  # fmt: skip
def test_gemm_compiles_for_hopper(index, n, k, row_div, mul_weight):
    """The Qwen3-30B-A3B GEMMs (gate/up: N 1536, K 2048; down: N 2048, K 768) with each tile
    config: they compile, fit in shared memory, pipeline their loads and use the tensor
    cores."""
    from pydaemon.layers.moe import triton_moe_kernels

    cfg = triton_moe._fit(triton_moe.TILE_CONFIGS[index][1], n, k)
    constexprs = {"A_ROW_DIV": row_div, "MUL_WEIGHT": mul_weight, "DOT_F32": False,
                  "EVEN_K": k % cfg.block_k == 0, "BLOCK_M": cfg.block_m,
                  "BLOCK_N": cfg.block_n, "BLOCK_K": cfg.block_k, "GROUP_M": cfg.group_m}  # fmt: skip
    kernel = compile_sm90(triton_moe_kernels.moe_gemm_kernel, _GEMM_SIGNATURE, constexprs,
                           cfg.num_warps, cfg.num_stages)  # fmt: skip
    assert kernel.metadata.shared <= HOPPER_SHARED_MEMORY, kernel.metadata.shared
    ptx = kernel.asm["ptx"]
    # tensor cores: wgmma from 64 rows a tile (a warp group's M), mma.sync below
    assert ("wgmma.mma_async" if cfg.block_m >= 64 else "mma.sync.aligned") in ptx
    if cfg.num_stages > 1:
        assert "cp.async" in ptx  # the K loop's loads are pipelined


@needs_triton
@pytest.mark.parametrize("block_m", [16, 128])
def test_align_compiles_for_hopper(block_m):
    from pydaemon.layers.moe import triton_moe_kernels

    signature = {"expert_ids_ptr": "*i32", "sorted_slots_ptr": "*i32",
                 "block_expert_ptr": "*i32", "num_slots": "i32", "max_blocks": "i32"}  # fmt: skip
    constexprs = {"NUM_EXPERTS": 128, "NUM_BINS": 256, "BLOCK_M": block_m,
                  "CHUNK": triton_moe.ALIGN_CHUNK}  # fmt: skip
    kernel = compile_sm90(triton_moe_kernels.moe_align_kernel, signature, constexprs, 4, 3)
    assert kernel.metadata.shared <= HOPPER_SHARED_MEMORY


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
