"""The W4A16 Triton kernels without a GPU: under Triton's interpreter
(tests/w4a16_interpreted.py in a pytest subprocess with TRITON_INTERPRET=1), and compiled ahead
of time for sm_90 (Hopper; Triton's compiler and its bundled ptxas need no GPU) for the
Llama-3-8B, Qwen3-30B-A3B and gpt-oss-20b shapes with the default tiles, within the H200's
shared memory. The cases skip where triton is not installed."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pydaemon.quantization import w4a16

ROOT = Path(__file__).resolve().parents[1]
HOPPER_SHARED_MEMORY = 227 * 1024
needs_triton = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="triton not installed"
)


@needs_triton
def test_the_kernels_under_the_triton_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
           str(ROOT / "tests" / "w4a16_interpreted.py")]  # fmt: skip
    out = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=900)
    report = out.stdout[-8000:] + out.stderr[-2000:]
    assert out.returncode == 0, report
    summary = out.stdout.strip().splitlines()[-1]
    assert " passed" in summary and "skipped" not in summary, report


def _compile_sm90(fn, signature: dict, constexprs: dict, num_warps: int, num_stages: int):
    import triton

    if not hasattr(triton, "knobs"):
        pytest.skip("Triton's compile API differs before 3.4")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from pydaemon.quantization import w4a16_kernels

    if w4a16_kernels.INTERPRETED:
        pytest.skip("TRITON_INTERPRET is set for this process")
    div16 = [n for n in signature if n.endswith("_ptr") or "stride" in n]
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in div16}
    src = ASTSource(
        fn=fn,
        signature={**signature, **dict.fromkeys(constexprs, "constexpr")},
        constexprs=constexprs,
        attrs=attrs,
    )
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": num_warps, "num_stages": num_stages})  # fmt: skip


def _pointers(scale: str) -> dict:
    return {"a_ptr": "*bf16", "w_ptr": "*i32", "scale_ptr": scale, "zero_ptr": "*u8",
            "perm_ptr": "*i32", "bias_ptr": "*bf16"}  # fmt: skip


# (N, K, group, format, moe): Llama-3-8B qkv / o / gate_up / down, Qwen3-30B-A3B experts,
# gpt-oss-20b experts (MXFP4).
SHAPES = [(6144, 4096, 128, 0, False), (4096, 4096, 128, 0, False), (28672, 4096, 128, 0, False),
          (4096, 14336, 128, 0, False), (1536, 2048, 128, 0, True), (2048, 768, 128, 0, True),
          (5760, 2880, 32, 1, True), (2880, 2880, 32, 1, True)]  # fmt: skip


@needs_triton
@pytest.mark.parametrize("n,k,group,fmt,moe", SHAPES)
def test_gemv_compiles_for_hopper(n, k, group, fmt, moe):
    from pydaemon.quantization.w4a16_kernels import w4a16_gemv_kernel

    cfg = w4a16.gemv_config(n, k, group)
    sig = {**_pointers("*u8" if fmt else "*fp16"), "expert_ids_ptr": "*i32",
           "weight_ptr": "*fp32", "c_ptr": "*bf16", "num_rows": "i32", "stride_am": "i32",
           "stride_cm": "i32"}  # fmt: skip
    constexprs = dict(N=n, K=k, FORMAT=fmt, GROUP=group, HAS_ZP=fmt == 0, HAS_PERM=False,
                      HAS_BIAS=fmt == 1, MUL_WEIGHT=moe, MOE=moe, A_ROW_DIV=1,
                      BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k)  # fmt: skip
    kernel = _compile_sm90(w4a16_gemv_kernel, sig, constexprs, cfg.num_warps, 1)
    assert kernel.metadata.shared <= HOPPER_SHARED_MEMORY


@needs_triton
@pytest.mark.parametrize("rows", [16, 512])
@pytest.mark.parametrize("n,k,group,fmt,moe", SHAPES[1::2] + SHAPES[-2:-1])
def test_gemm_compiles_for_hopper(n, k, group, fmt, moe, rows):
    from pydaemon.quantization.w4a16_kernels import w4a16_gemm_kernel

    cfg = w4a16.gemm_config(rows, n, k, group)
    sig = {**_pointers("*u8" if fmt else "*fp16"), "sorted_slots_ptr": "*i32",
           "block_expert_ptr": "*i32", "weight_ptr": "*fp32", "c_ptr": "*bf16",
           "num_rows": "i32", "max_blocks": "i32", "stride_am": "i32", "stride_cm": "i32"}  # fmt: skip
    constexprs = dict(N=n, K=k, FORMAT=fmt, GROUP=group, HAS_ZP=fmt == 0, HAS_PERM=False,
                      HAS_BIAS=False, MUL_WEIGHT=moe, MOE=moe, A_ROW_DIV=1, DOT_F32=False,
                      BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                      GROUP_M=cfg.group_m)  # fmt: skip
    kernel = _compile_sm90(w4a16_gemm_kernel, sig, constexprs, cfg.num_warps, cfg.num_stages)
    assert kernel.metadata.shared <= HOPPER_SHARED_MEMORY
    assert "mma" in kernel.asm["ptx"]  # tensor cores


def test_the_cpu_is_not_served_by_the_kernels():
    import torch

    assert not w4a16.supports(torch.zeros(2, 8, dtype=torch.bfloat16))
