"""The W4A16 Triton kernels (pydaemon/quantization/w4a16_kernels.py) on the CPU under Triton's
interpreter. Not collected by itself: tests/test_w4a16_triton.py runs this file in a pytest
subprocess with TRITON_INTERPRET=1 set before anything imports triton.

Checked against float64 references on fresh random inputs: the dense GEMV and GEMM (int4
symmetric / with zero points, groups 16, 32, 128 and per channel, act-order through perm, K
and N tails), and both MoE paths (per-slot GEMV, expert-sorted GEMM) for int4 and MXFP4 with
biases and routing weights. What the interpreter does not show: the compiled kernels and
their speed (tests/gpu/test_w4a16_gpu.py, bench/bench_int4_gemm.py)."""

from __future__ import annotations

import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip(
        "run by tests/test_w4a16_triton.py under TRITON_INTERPRET=1", allow_module_level=True
    )
pytest.importorskip("triton", reason="triton is not installed")

from pydaemon.layers.moe import w4a16_moe  # noqa: E402
from pydaemon.layers.moe.int4 import dequantize_expert  # noqa: E402
from pydaemon.layers.moe.router import select_experts  # noqa: E402
from pydaemon.layers.moe.w4a16_moe import ExpertWeights  # noqa: E402
from pydaemon.quantization import w4a16, w4a16_kernels  # noqa: E402
from pydaemon.quantization.int4 import dequantize_int4, pack_int4  # noqa: E402
from pydaemon.quantization.mxfp4 import quantize_mxfp4  # noqa: E402


def test_the_kernels_are_interpreted():
    assert w4a16_kernels.INTERPRETED


def _int4_layer(n, k, group, zp, act_order, gen, e=None):
    lead = () if e is None else (e,)
    q = torch.randint(0, 16, (*lead, n, k), generator=gen)
    g = group or k
    scales = (torch.rand(*lead, n, k // g, generator=gen) * 0.02 + 0.005).half()
    zeros = torch.randint(0, 16, (*lead, n, k // g), generator=gen).to(torch.uint8) if zp else None
    perm = None
    if act_order:
        perm = torch.stack([torch.randperm(k, generator=gen) for _ in range(e or 1)]).to(
            torch.int32
        )
        perm = perm if e else perm[0]
    return pack_int4(q), scales, zeros, perm


def _reference_dense(x, qweight, scales, zeros, perm):
    w = dequantize_int4(qweight, scales, zeros, torch.float64)
    xs = x.double() if perm is None else x.double()[:, perm.long()]
    return xs @ w.t()


@pytest.mark.parametrize("n,k,group,zp,act_order,dtype", [
    (40, 256, 32, True, False, torch.bfloat16), (24, 128, None, False, False, torch.float16),
    (16, 96, 16, True, True, torch.bfloat16), (32, 512, 128, False, False, torch.float16),
])  # fmt: skip
@pytest.mark.parametrize("rows", [1, 5])  # the GEMV, the GEMM
def test_dense_kernels(dtype, n, k, group, zp, act_order, rows):
    gen = torch.Generator().manual_seed(n * k + rows)
    qweight, scales, zeros, perm = _int4_layer(n, k, group, zp, act_order, gen)
    x = torch.randn(rows, k, generator=gen).to(dtype)
    want = _reference_dense(x, qweight, scales, zeros, perm)
    got = w4a16.linear(x, qweight, scales, zeros, perm)
    assert got.dtype == dtype and got.shape == (rows, n)
    err = (got.double() - want).abs().max() / want.abs().max()
    # bf16: the weights rounded to bf16 for the tensor-core GEMM (2^-9 each) and the output
    assert err < (2e-2 if dtype == torch.bfloat16 else 4e-3), err


@pytest.mark.parametrize("gemv_config", [w4a16.GemvConfig(8, 64, 4), w4a16.GemvConfig(16, 256, 4)])
def test_gemv_tiles(gemv_config):
    gen = torch.Generator().manual_seed(7)
    qweight, scales, zeros, _ = _int4_layer(24, 320, 32, True, False, gen)
    x = torch.randn(1, 320, generator=gen).to(torch.float16)
    w = w4a16.PackedWeights(qweight[None], scales[None], zeros[None], None, None, 0, 32)
    got = w4a16.launch_gemv(x, w, 1, config=gemv_config)
    want = _reference_dense(x, qweight, scales, zeros, None)
    assert ((got.double() - want).abs().max() / want.abs().max()) < 4e-3


def _moe_reference(x, w13, w2, topk_weights, topk_ids):
    t, k = topk_ids.shape
    out = torch.zeros(t, x.shape[1], dtype=torch.float64)
    for ti in range(t):
        for j in range(k):
            e = int(topk_ids[ti, j])
            h = x[ti].double() @ dequantize_expert(w13, e, torch.float64).t()
            if w13.bias is not None:
                h = h + w13.bias[e].double()
            inter = h.shape[0] // 2
            a = torch.nn.functional.silu(h[:inter]) * h[inter:]
            y = a @ dequantize_expert(w2, e, torch.float64).t()
            if w2.bias is not None:
                y = y + w2.bias[e].double()
            out[ti] += topk_weights[ti, j].double() * y
    return out


def _moe_weights(kind, e, n, k, gen, zp=True, act_order=False, bias=False):
    if kind == "int4":
        qweight, scales, zeros, perm = _int4_layer(n, k, 32, zp, act_order, gen, e=e)
        b = torch.randn(e, n, generator=gen) * 0.1 if bias else None
        return ExpertWeights(qweight, scales, zeros, perm, b, "int4")
    w = torch.randn(e, n, k, generator=gen) * 0.05
    packed, scales = quantize_mxfp4(w)
    b = (torch.randn(e, n, generator=gen) * 0.1).to(torch.bfloat16) if bias else None
    return ExpertWeights(packed, scales, None, None, b, "mxfp4")


@pytest.mark.parametrize("kind,zp,act_order,bias", [
    ("int4", True, False, False), ("int4", False, True, False), ("mxfp4", False, False, True),
])  # fmt: skip
@pytest.mark.parametrize("tokens", [2, 9])
def test_moe_paths(kind, zp, act_order, bias, tokens, monkeypatch):
    e, h, inter, top_k = 6, 64, 32, 2
    gen = torch.Generator().manual_seed(tokens * 11 + len(kind))
    w13 = _moe_weights(kind, e, 2 * inter, h, gen, zp, act_order, bias)
    w2 = _moe_weights(kind, e, h, inter, gen, zp, act_order, bias)
    # float16: the interpreter emulates bfloat16 by truncation (numpy has none), ~3x the error
    x = torch.randn(tokens, h, generator=gen).to(torch.float16)
    logits = torch.randn(tokens, e, generator=gen)
    topk_weights, topk_ids = select_experts(logits, top_k, "softmax", True)
    want = _moe_reference(x, w13, w2, topk_weights, topk_ids)
    from pydaemon.layers.activation import SiluAndMul

    for bound in (0, 1 << 20):  # the GEMM path, then the per-slot GEMV path
        monkeypatch.setattr(w4a16_moe, "MOE_GEMV_MAX_TOKENS", bound)
        got = w4a16_moe.fused_experts(x, w13, w2, topk_weights, topk_ids, SiluAndMul())
        diff = got.double() - want
        rms = float(diff.pow(2).mean().sqrt() / want.pow(2).mean().sqrt())
        worst = float(diff.abs().max() / want.abs().max())
        # fp16 roundings of the weights, of h and of the output, through the SiLU product
        assert rms < 3e-3 and worst < 1e-2, (bound, rms, worst)
