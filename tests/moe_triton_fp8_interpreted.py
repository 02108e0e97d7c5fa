"""The FP8 Triton fused-MoE path (pydaemon/layers/moe/triton_moe_fp8.py) on the CPU under
Triton's interpreter. Not collected by itself: tests/test_moe_triton_fp8.py runs this file in
a pytest subprocess with TRITON_INTERPRET=1 (as tests/moe_triton_interpreted.py for bf16).

Checked against float64 references on fresh random inputs: the GEMM kernel alone (FP8 weights
with per-channel or block scales; activations FP8 with per-row scales, w8a8, or float / bf16
as they are, w8a16; token rows and slot rows; the routing weight in the epilogue; sizes that
are not multiples of the tiles; scale blocks larger than BLOCK_K), the whole expert path in
both modes (w8a16 against the dequantized weights exactly up to float32 sums; w8a8 against
the emulated grouped path, which quantizes the activations the same way), routing with every
token on two experts and with one token, bf16 activations, and the FusedMoE layer sending its
FP8 steps here. What the interpreter does not show (the compiled kernels, FP8 tensor cores,
speed) is in tests/test_moe_triton_fp8.py (sm_90 compilation) and tests/gpu/."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from pydaemon.layers.moe import FusedMoE, triton_moe, triton_moe_fp8
from pydaemon.layers.moe.router import select_experts
from pydaemon.layers.moe.triton_moe import TileConfig
from pydaemon.quantization.config import Fp8Config
from pydaemon.quantization.fp8 import (
    FP8_DTYPE,
    dequantize_blocks,
    quantize_per_channel,
    quantize_per_token,
)

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip(
        "run by tests/test_moe_triton_fp8.py under TRITON_INTERPRET=1", allow_module_level=True
    )
pytest.importorskip("triton", reason="triton is not installed")
from pydaemon.layers.moe import triton_moe_kernels  # noqa: E402

CONFIGS = [TileConfig(16, 32, 32, 1, 4, 2), TileConfig(32, 16, 16, 2, 4, 2)]


def test_the_kernels_are_interpreted():
    assert triton_moe_kernels.INTERPRETED


def _quantize(w: torch.Tensor, block: tuple[int, int] | None):
    """w: [E, N, K] float32 -> (wq fp8, scales, dequantized float64)."""
    qs, ss = [], []
    for we in w:
        if block is None:
            q, s = quantize_per_channel(we)
        else:
            bn, bk = block
            n, k = we.shape
            rows, cols = -(-n // bn), -(-k // bk)
            s = torch.empty(rows, cols)
            q = torch.empty(n, k, dtype=FP8_DTYPE)
            for r in range(rows):
                for c in range(cols):
                    part = we[r * bn : (r + 1) * bn, c * bk : (c + 1) * bk]
                    s[r, c] = part.abs().max() / 448.0
                    q[r * bn : (r + 1) * bn, c * bk : (c + 1) * bk] = (part / s[r, c]).to(FP8_DTYPE)
        qs.append(q)
        ss.append(s)
    wq, scales = torch.stack(qs), torch.stack(ss)
    deq = torch.stack([_dequantize(wq[e], scales[e], block) for e in range(w.shape[0])])
    return wq, scales, deq


def _dequantize(wq, scale, block) -> torch.Tensor:  # [N, K] float64
    if block is None:
        return wq.double() * scale.double()[:, None]
    return dequantize_blocks(wq, scale, block).double()


def _ids(t: int, e: int, k: int, g: torch.Generator) -> torch.Tensor:
    return torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]).to(torch.int32)


@pytest.mark.parametrize("a_fp8", [True, False], ids=["w8a8", "w8a16"])
@pytest.mark.parametrize("block", [None, (16, 32), (32, 64)], ids=["channel", "b16x32", "b32x64"])
@pytest.mark.parametrize("n,kdim", [(64, 64), (40, 48)])
@pytest.mark.parametrize("cfg", CONFIGS, ids=["bm16", "bm32"])
def test_gemm_matches_float64(a_fp8, block, n, kdim, cfg):
    """c[s] = weight[s] * dq(a)[s // 2] @ dq(w[e_s]).T for every slot, padding rows unwritten."""
    e, k, t = 8, 2, 13
    g = torch.Generator().manual_seed(n + kdim + (block or (0,))[0] + cfg.block_m)
    w = torch.randn(e, n, kdim, generator=g) * 0.2
    wq, scales, w64 = _quantize(w, block)
    x = torch.randn(t, kdim, generator=g)
    if a_fp8:
        a, a_scale = quantize_per_token(x)
        a64 = a.double() * a_scale.double()
    else:
        a, a_scale, a64 = x, None, x.double()
    ids = _ids(t, e, k, g)
    weights = torch.rand(t * k, generator=g)
    sorted_slots, block_expert = triton_moe.moe_align_blocks(ids, e, cfg.block_m)
    out = triton_moe_fp8.moe_gemm_fp8(a, a_scale, wq, scales, block, sorted_slots, block_expert,
                                      t * k, k, cfg, torch.float32, weights)  # fmt: skip
    flat = ids.reshape(-1).long()
    ref = torch.stack([weights[s].double() * (w64[flat[s]] @ a64[s // k]) for s in range(t * k)])
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)


def _reference(x, w13, w2, weights, ids) -> torch.Tensor:  # float64, unquantized activations
    x, weights = x.double(), weights.double()
    i = w2.shape[2]
    out = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float64)
    for t in range(x.shape[0]):
        for j, e in enumerate(ids[t].tolist()):
            h = w13[e] @ x[t]
            out[t] += weights[t, j] * (w2[e] @ (F.silu(h[:i]) * h[i:]))
    return out


def _experts(e, h, i, block, g):
    w13q, s13, w13 = _quantize(torch.randn(e, 2 * i, h, generator=g) * 0.2, block)
    w2q, s2, w2 = _quantize(torch.randn(e, h, i, generator=g) * 0.2, block)
    return (w13q, s13, w2q, s2), (w13, w2)


def _routing(t, e, k, case, g):
    logits = torch.randn(t, e, generator=g)
    if case == "crowded":  # every token on experts 1 and e - 1, the others idle
        logits[:, 1] += 50.0
        logits[:, e - 1] += 40.0
    return select_experts(logits, k, "softmax", True)


@pytest.mark.parametrize("block", [None, (16, 32)], ids=["channel", "block"])
@pytest.mark.parametrize("t,case", [(1, "random"), (17, "random"), (40, "crowded")])
def test_w8a16_matches_the_dequantized_weights(block, t, case):
    """w8a16: only the weights are quantized, so the path equals the float64 product of x and
    the dequantized weights up to float32 sums and the float32 rounding of h and a."""
    e, k, h, i = 8, 2, 64, 32
    g = torch.Generator().manual_seed(t + (block is None))
    quant, (w13, w2) = _experts(e, h, i, block, g)
    x = torch.randn(t, h, generator=g)
    weights, ids = _routing(t, e, k, case, g)
    out = triton_moe_fp8.fused_experts_triton_fp8(x, *quant, weights, ids, block_shape=block,
                                                  w8a8=False)  # fmt: skip
    assert out.dtype == torch.float32 and out.shape == (t, h)
    torch.testing.assert_close(out.double(), _reference(x, w13, w2, weights, ids),
                               rtol=1e-5, atol=1e-5)  # fmt: skip


def _emulated(x, quant, weights, ids, block):
    """The emulated grouped path of the FP8 method on the same weights (per-token activation
    quantization, then float32 products of the dequantized values)."""
    e, two_i, h = quant[0].shape
    layer = FusedMoE(e, ids.shape[1], h, two_i // 2, renormalize=True,
                     quant_config=Fp8Config(None, emulate=True))  # fmt: skip
    layer.quant_method.block_shape = block
    layer.w13_weight, layer.w13_weight_scale, layer.w2_weight, layer.w2_weight_scale = (
        torch.nn.Parameter(p, requires_grad=False) for p in quant
    )
    return layer.quant_method.apply(layer, x, weights, ids)


@pytest.mark.parametrize("block", [None, (16, 32)], ids=["channel", "block"])
@pytest.mark.parametrize("t,case", [(3, "random"), (33, "random"), (40, "crowded")])
def test_w8a8_matches_the_emulated_path(block, t, case):
    """w8a8 quantizes x per token and the SiLU-and-mul output per slot as the emulated grouped
    path does; the two differ in the order of float32 sums, which can move an activation
    across an e4m3 rounding boundary (one step, 2^-3 relative at most, in a few entries)."""
    e, k, h, i = 8, 2, 64, 32
    g = torch.Generator().manual_seed(3 * t + (block is None))
    quant, (w13, w2) = _experts(e, h, i, block, g)
    x = torch.randn(t, h, generator=g)
    weights, ids = _routing(t, e, k, case, g)
    out = triton_moe_fp8.fused_experts_triton_fp8(x, *quant, weights, ids, block_shape=block,
                                                  w8a8=True)  # fmt: skip
    emulated = _emulated(x, quant, weights, ids, block)
    ref = _reference(x, w13, w2, weights, ids)
    scale = ref.abs().max().item()
    torch.testing.assert_close(out.double(), emulated.double(), rtol=0, atol=2e-2 * scale)
    # Both carry the activations' FP8 error (e4m3: 2^-4 relative per value) against float64.
    err = (out.double() - ref).abs().max().item()
    emulated_err = (emulated.double() - ref).abs().max().item()
    assert err <= 2 * emulated_err + 1e-6 * scale, (err, emulated_err)
    assert err <= 0.1 * scale


@pytest.mark.parametrize("w8a8", [False, True])
def test_bf16_activations(w8a8):
    e, k, h, i, t = 8, 2, 64, 32, 9
    g = torch.Generator().manual_seed(11 + w8a8)
    quant, (w13, w2) = _experts(e, h, i, None, g)
    x = torch.randn(t, h, generator=g).to(torch.bfloat16)
    weights, ids = _routing(t, e, k, "random", g)
    out = triton_moe_fp8.fused_experts_triton_fp8(x, *quant, weights, ids, w8a8=w8a8)
    assert out.dtype == torch.bfloat16
    ref = _reference(x, w13, w2, weights, ids)
    scale = ref.abs().max().item()
    bound = (0.1 if w8a8 else 4 * 2.0**-8) * scale  # activations' e4m3 rounding, or bf16's
    assert (out.double() - ref).abs().max().item() <= bound


def test_empty_step():
    g = torch.Generator().manual_seed(0)
    quant, _ = _experts(8, 64, 32, None, g)
    x = torch.randn(0, 64)
    weights, ids = torch.zeros(0, 2), torch.zeros(0, 2, dtype=torch.int32)
    assert triton_moe_fp8.fused_experts_triton_fp8(x, *quant, weights, ids).shape == (0, 64)


@pytest.mark.parametrize("t", [2, 30])
def test_fused_moe_layer_sends_fp8_steps_here(monkeypatch, t):
    """A FusedMoE layer with FP8 weights (not emulated) runs the Triton FP8 path where it can
    (CUDA only: ``supports`` is forced here), w8a16 up to W8A16_MAX_TOKENS tokens and w8a8
    above; its output is the emulated layer's within the activations' FP8 error."""
    monkeypatch.setattr(triton_moe_fp8, "W8A16_MAX_TOKENS", 16)
    calls = []
    real = triton_moe_fp8.moe_gemm_fp8

    def spy(a, *args, **kw):
        calls.append(a.dtype)
        return real(a, *args, **kw)

    monkeypatch.setattr(triton_moe_fp8, "moe_gemm_fp8", spy)
    monkeypatch.setattr(triton_moe_fp8, "supports", lambda *a: True)
    e, k, h, i = 8, 2, 64, 32
    g = torch.Generator().manual_seed(t)
    quant, (w13, w2) = _experts(e, h, i, None, g)
    layer = FusedMoE(e, k, h, i, renormalize=True, quant_config=Fp8Config(None, emulate=False))
    layer.w13_weight, layer.w13_weight_scale, layer.w2_weight, layer.w2_weight_scale = (
        torch.nn.Parameter(p, requires_grad=False) for p in quant
    )
    x = torch.randn(t, h, generator=g)
    logits = torch.randn(t, e, generator=g)
    out = layer(x, logits)
    want = torch.float32 if t <= 16 else FP8_DTYPE
    assert calls == [want, want]
    weights, ids = select_experts(logits, k, "softmax", True)
    ref = _reference(x, w13, w2, weights, ids)
    assert (out.double() - ref).abs().max().item() <= 0.1 * ref.abs().max().item()
