"""The FP8 Triton fused-MoE path (pydaemon/layers/moe/triton_moe_fp8.py) without a GPU: its
kernel under Triton's interpreter (tests/moe_triton_fp8_interpreted.py in a pytest subprocess
with TRITON_INTERPRET=1), the kernel compiled ahead of time for sm_90 with every tile config of
the table in the mode the table's step sizes run (w8a16 up to W8A16_MAX_TOKENS, w8a8 above),
per-channel and 128 x 128 block scales, on the Qwen3-30B-A3B and Mixtral-8x7B expert shapes:
within the H200's shared memory, loads pipelined, and the products on the tensor cores the
mode needs (w8a8 tiles of 64 rows and more: FP8 wgmma, e4m3 x e4m3); and the tile rules
(spreading few experts' columns over the SMs, BLOCK_K against scale blocks)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
from triton_sm90 import HOPPER_SHARED_MEMORY, compile_sm90

from pydaemon.layers.moe import triton_moe, triton_moe_fp8
from pydaemon.layers.moe.triton_moe import TileConfig

ROOT = Path(__file__).resolve().parents[1]
needs_triton = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="triton not installed"
)


@needs_triton
def test_the_kernel_under_the_triton_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
           str(ROOT / "tests" / "moe_triton_fp8_interpreted.py")]  # fmt: skip
    out = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=900)
    report = out.stdout[-8000:] + out.stderr[-2000:]
    assert out.returncode == 0, report
    summary = out.stdout.strip().splitlines()[-1]
    assert " passed" in summary and "skipped" not in summary, report


def _signature(a_fp8: bool) -> dict:
    return {
        "a_ptr": "*fp8e4nv" if a_fp8 else "*bf16", "a_scale_ptr": "*fp32",
        "w_ptr": "*fp8e4nv", "w_scale_ptr": "*fp32", "c_ptr": "*bf16",
        "sorted_slots_ptr": "*i32", "block_expert_ptr": "*i32", "weight_ptr": "*fp32",
        "N": "i32", "K": "i32", "num_slots": "i32", "max_blocks": "i32", "stride_am": "i32",
        "stride_we": "i32", "stride_wn": "i32", "stride_wk": "i32", "stride_cm": "i32",
        "stride_se": "i32", "stride_sn": "i32", "stride_sk": "i32",
    }  # fmt: skip


def _compile(cfg: TileConfig, n: int, k: int, a_fp8: bool, block, row_div: int, mul: bool):
    from pydaemon.layers.moe import triton_moe_fp8_kernels

    cfg = triton_moe_fp8._fit_fp8(cfg, n, k, block, a_fp8)
    constexprs = {"A_ROW_DIV": row_div, "MUL_WEIGHT": mul, "A_FP8": a_fp8,
                  "SCALE_BN": block[0] if block else 0, "SCALE_BK": block[1] if block else 0,
                  "DOT_F32": False, "EVEN_K": k % cfg.block_k == 0, "BLOCK_M": cfg.block_m,
                  "BLOCK_N": cfg.block_n, "BLOCK_K": cfg.block_k,
                  "GROUP_M": cfg.group_m}  # fmt: skip
    kernel = compile_sm90(triton_moe_fp8_kernels.moe_gemm_fp8_kernel, _signature(a_fp8),
                          constexprs, cfg.num_warps, cfg.num_stages)  # fmt: skip
    return cfg, kernel


def _check(cfg: TileConfig, kernel, a_fp8: bool) -> None:
    assert kernel.metadata.shared <= HOPPER_SHARED_MEMORY, kernel.metadata.shared
    ptx = kernel.asm["ptx"]
    if cfg.block_m >= 64:  # a warp group's rows: wgmma, on FP8 operands for w8a8
        dot = "wgmma.mma_async.sync.aligned"
        assert dot in ptx
        ops = ".e4m3.e4m3" if a_fp8 else ".bf16.bf16"
        assert any(ops in line for line in ptx.splitlines() if dot in line), ops
    else:  # below: mma.sync (Triton widens 8-bit operands to f16 there)
        assert "mma.sync.aligned" in ptx
    if cfg.num_stages > 1:
        assert "cp.async" in ptx  # the K loop's loads are pipelined


SHAPES = {  # (N, K) of the gate/up and the down GEMM
    "qwen3": ((1536, 2048), (2048, 768)),
    "mixtral": ((28672, 4096), (4096, 14336)),
}


@needs_triton
@pytest.mark.parametrize("index", range(len(triton_moe_fp8.FP8_TILE_CONFIGS)))
@pytest.mark.parametrize("block", [None, (128, 128)], ids=["channel", "block128"])
@pytest.mark.parametrize("gemm", ["gate_up", "down"])
def test_fp8_gemm_compiles_for_hopper(index, block, gemm):
    """Each tile config on the Qwen3-30B-A3B GEMMs, in the mode its step sizes run."""
    bound, cfg = triton_moe_fp8.FP8_TILE_CONFIGS[index]
    a_fp8 = bound > triton_moe_fp8.W8A16_MAX_TOKENS
    n, k = SHAPES["qwen3"][0 if gemm == "gate_up" else 1]
    row_div, mul = (8, False) if gemm == "gate_up" else (1, True)
    cfg, kernel = _compile(cfg, n, k, a_fp8, block, row_div, mul)
    _check(cfg, kernel, a_fp8)


@needs_triton
@pytest.mark.parametrize("a_fp8", [False, True], ids=["w8a16", "w8a8"])
def test_spread_decode_tiles_compile_for_hopper(a_fp8):
    """Mixtral at one token: the down GEMM's tile spread to 16 columns over the SMs."""
    n, k = SHAPES["mixtral"][1]
    cfg = triton_moe.spread_block_n_for(triton_moe_fp8.fp8_tile_config(1), n, 2, 2 * 132)
    assert cfg.block_n == 16
    cfg, kernel = _compile(cfg, n, k, a_fp8, None, 1, True)
    _check(cfg, kernel, a_fp8)


def test_w8a16_covers_the_tiles_under_a_warp_group():
    """W8A16_MAX_TOKENS is where the table's tiles reach 64 rows (wgmma): below, FP8 dots
    would run on widened operands anyway (see _check)."""
    for bound, cfg in triton_moe_fp8.FP8_TILE_CONFIGS:
        assert (bound <= triton_moe_fp8.W8A16_MAX_TOKENS) == (cfg.block_m < 64), (bound, cfg)


def test_spread_block_n_gives_the_sms_work():
    cfg = TileConfig(16, 64, 256, 1, 4, 4)
    sms = 132
    # Mixtral at one token: 2 experts; down N 4096: 128 programs at 64 columns -> 16
    assert triton_moe.spread_block_n_for(cfg, 4096, 2, 2 * sms).block_n == 16
    # its gate/up, N 28672: 896 programs at 64 columns, enough
    assert triton_moe.spread_block_n_for(cfg, 28672, 2, 2 * sms).block_n == 64
    # Qwen3-30B-A3B at one token: 8 experts; gate/up N 1536: 192 -> 32 columns, 384 programs
    assert triton_moe.spread_block_n_for(cfg, 1536, 8, 2 * sms).block_n == 32
    # never below MIN_BLOCK_N, whatever the shortfall
    assert triton_moe.spread_block_n_for(cfg, 64, 1, 10**6).block_n == triton_moe.MIN_BLOCK_N
    # nothing else changes
    assert triton_moe.spread_block_n_for(cfg, 4096, 2, 2 * sms)._replace(block_n=64) == cfg


def test_spread_block_n_keeps_cpu_configs():
    import torch

    cfg = TileConfig(16, 64, 256, 1, 4, 4)
    assert triton_moe.spread_block_n(cfg, 4096, 2, 8, torch.device("cpu")) == cfg


@pytest.mark.parametrize(
    "block,a_fp8,block_k,want",
    [
        (None, False, 256, 256),
        (None, True, 16, 32),  # FP8 dots take K 32 at least
        ((128, 128), False, 256, 128),  # a K step inside one scale block
        ((128, 128), True, 256, 128),
        ((16, 48), False, 64, 16),
    ],
)
def test_fit_fp8_block_k(block, a_fp8, block_k, want):
    cfg = TileConfig(16, 64, block_k, 1, 4, 3)
    assert triton_moe_fp8._fit_fp8(cfg, 4096, 4096, block, a_fp8).block_k == want


def test_fit_fp8_refuses_blocks_finer_than_an_fp8_dot():
    cfg = TileConfig(16, 64, 128, 1, 4, 3)
    with pytest.raises(ValueError, match="block scales"):
        triton_moe_fp8._fit_fp8(cfg, 4096, 4096, (128, 16), True)


def test_tile_configs_by_tokens():
    bounds = [b for b, _ in triton_moe_fp8.FP8_TILE_CONFIGS]
    assert bounds == sorted(bounds)
    assert triton_moe_fp8.fp8_tile_config(1).block_m == 16
    assert triton_moe_fp8.fp8_tile_config(8192).block_m >= 64


def test_supports_needs_cuda():
    import torch

    w = torch.zeros(2, 32, 32, dtype=torch.float8_e4m3fn)
    assert not triton_moe_fp8.supports(torch.zeros(1, 32, dtype=torch.bfloat16), w, w)


def test_fp8_layer_sends_decode_steps_to_the_decode_kernels(monkeypatch):
    """FP8 steps the decode kernels serve (use_fp8_decode_kernels: CUDA only, forced here by
    slot count) go to ops.moe_decode_gate_up_fp8 / moe_decode_down_combine_fp8 with the layer's
    weights, scales and block shape; larger ones do not. The kernels are stood in for by their
    float math (tests/gpu/test_moe_decode_fp8_gpu.py checks the real ones)."""
    import torch
    import torch.nn.functional as F

    from pydaemon import ops
    from pydaemon.layers.moe import FusedMoE
    from pydaemon.layers.moe import fp8 as moe_fp8
    from pydaemon.quantization.config import Fp8Config
    from pydaemon.quantization.fp8 import quantize_per_channel

    e, k, h, i = 8, 2, 64, 32
    layer = FusedMoE(e, k, h, i, renormalize=True, quant_config=Fp8Config(None, emulate=False))
    g = torch.Generator().manual_seed(0)
    for name, (n, kk) in (("w13", (2 * i, h)), ("w2", (h, i))):
        qs = [quantize_per_channel(torch.randn(n, kk, generator=g) * 0.2) for _ in range(e)]
        getattr(layer, f"{name}_weight").data = torch.stack([q for q, _ in qs])
        getattr(layer, f"{name}_weight_scale").data = torch.stack([s for _, s in qs])
    calls = []

    def dq(w, s, e_):
        return w[e_].float() * s[e_][:, None]

    def gate_up(x, ids, w13, s13, block_shape):
        calls.append(("gate_up", x.shape[0], block_shape))
        rows = [dq(w13, s13, e_) @ x[0] for e_ in ids.tolist()[0]]  # token 0's slots
        hh = torch.stack(rows)
        return F.silu(hh[:, :i]) * hh[:, i:]

    def down(act, ids, weights, w2, s2, block_shape):
        calls.append(("down", act.shape[0], block_shape))
        ys = [dq(w2, s2, e_) @ act[j] for j, e_ in enumerate(ids.tolist()[0])]
        return (torch.stack(ys) * weights[0][:, None]).sum(0, keepdim=True)

    monkeypatch.setattr(moe_fp8, "use_fp8_decode_kernels", lambda x, w13, ids, bs: ids.numel() <= 2)
    monkeypatch.setattr(ops, "moe_decode_gate_up_fp8", gate_up)
    monkeypatch.setattr(ops, "moe_decode_down_combine_fp8", down)
    x = torch.randn(1, h, generator=g)
    logits = torch.randn(1, e, generator=g)
    out = layer(x, logits)
    assert calls == [("gate_up", 1, None), ("down", 2, None)]
    layer.quant_method.emulate = True  # the emulated path, activations quantized: close
    ref = layer(x, logits)
    torch.testing.assert_close(out, ref, rtol=0, atol=0.1 * ref.abs().max().item())
    layer.quant_method.emulate = False
    layer(torch.randn(3, h, generator=g), torch.randn(3, e, generator=g))  # 6 slots: not them
    assert len(calls) == 2
