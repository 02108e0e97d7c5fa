"""The MoE decode kernels with FP8 weights (moe_decode_gate_up_fp8, moe_decode_down_combine_fp8:
cpp/cuda/moe_decode_fp8_kernels.cu) against float64 references on fresh random inputs, with
per-channel and 128 x 128 block scales, on the Qwen3-30B-A3B (E 128, H 2048, I 768) and
Mixtral-8x7B (E 8, H 4096, I 14336) expert shapes and a tiny one with blocks that do not divide
the sizes; against the Triton FP8 path (w8a16, the same operands); expert ids out of range;
replay from a CUDA graph after x, the ids and the scales changed in place; the FusedMoE layer
taking them for decode-sized FP8 steps (experts.MOE_DECODE_MAX_SLOTS); the binding's checks.

The references are float64 products of x (as stored) and the dequantized weights, with the
roundings the kernels make on purpose (gate, up, silu, the product and each expert's output
rounded to the dtype): nearly every element is the reference rounded once, the others one ulp
of an intermediate value off (bounded by a few unit roundoffs of the terms' size).
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

from pydaemon import ops
from pydaemon.layers.moe import FusedMoE, experts, triton_moe_fp8
from pydaemon.layers.moe.router import select_experts
from pydaemon.quantization.config import Fp8Config
from pydaemon.quantization.fp8 import dequantize_blocks, quantize_per_channel, to_fp8

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or not ops.moe_decode_fp8_kernels_available(),
    reason="needs a CUDA GPU and pagedd's FP8 MoE decode kernels",
)

UNIT_ROUNDOFF = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}
SHAPES = [(128, 2048, 768), (8, 4096, 14336), (4, 64, 48)]  # (E, H, I)


def _quantize(w: torch.Tensor, block: tuple[int, int] | None):
    """w [N, K] float32 -> (wq fp8, scales, dequantized float64)."""
    if block is None:
        q, s = quantize_per_channel(w)
        return q, s, q.double() * s.double()[:, None]
    bn, bk = block
    n, k = w.shape
    rows, cols = -(-n // bn), -(-k // bk)
    padded = torch.zeros(rows * bn, cols * bk, device=w.device)
    padded[:n, :k] = w
    s = padded.view(rows, bn, cols, bk).abs().amax(dim=(1, 3)) / 448.0
    full = s.repeat_interleave(bn, 0).repeat_interleave(bk, 1)[:n, :k]
    q = to_fp8(w / full)
    return q, s, dequantize_blocks(q, s, block).double()


@functools.lru_cache(maxsize=3)
def _experts(e: int, h: int, i: int, block: tuple[int, int] | None):
    """((w13q, s13, w2q, s2), (w13, w2) float64): rows of norm ~1."""
    g = torch.Generator(device="cuda").manual_seed(e * 7919 + h * 31 + i)
    parts = []
    for n, k in ((2 * i, h), (h, i)):
        qs, ss, ds = [], [], []
        for _ in range(e):
            q, s, d = _quantize(torch.randn(n, k, device="cuda", generator=g) * k**-0.5, block)
            qs.append(q)
            ss.append(s)
            ds.append(d)
        parts.append((torch.stack(qs), torch.stack(ss), torch.stack(ds)))
    (w13q, s13, w13), (w2q, s2, w2) = parts
    return (w13q, s13, w2q, s2), (w13, w2)


def _routing(t: int, k: int, e: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    weights = torch.randn(t, k, generator=g).softmax(-1)
    return ids.to("cuda", torch.int32), weights.cuda()


def _round(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return x.to(dtype).double()


def _reference(x, w13, w2, ids, weights, dtype):
    """float64 act [S, I] and out [T, H] with the kernels' roundings."""
    t, k = ids.shape
    i = w2.shape[2]
    slots = ids.reshape(-1).long()
    rows = x.double().repeat_interleave(k, 0)  # [S, H]
    h = torch.stack([w13[e] @ rows[s] for s, e in enumerate(slots.tolist())])  # [S, 2I]
    g, u = _round(h[:, :i], dtype), _round(h[:, i:], dtype)
    act = _round(_round(F.silu(g), dtype) * u, dtype)
    y = torch.stack([w2[e] @ act[s] for s, e in enumerate(slots.tolist())])  # [S, H]
    y = _round(y, dtype).view(t, k, -1)
    out = (y * weights.double()[..., None]).sum(1)
    return act, out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("block", [None, (128, 128), (32, 48)], ids=["channel", "b128", "b32x48"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"E{s[0]}H{s[1]}I{s[2]}")
def test_matches_float64(shape, block, dtype):
    e, h, i = shape
    if block == (32, 48) and shape != (4, 64, 48):
        pytest.skip("the odd blocks on the tiny shape only")
    if block == (128, 128) and shape == (4, 64, 48):
        pytest.skip("128 x 128 blocks on the model shapes")
    quant, (w13, w2) = _experts(e, h, i, block)
    k = 8 if e >= 8 else 2
    t = 1 if e == 128 else 4
    ids, weights = _routing(t, k, e, seed=h + i)
    x = torch.randn(t, h, device="cuda").to(dtype)
    act = ops.moe_decode_gate_up_fp8(x, ids, quant[0], quant[1], block)
    out = ops.moe_decode_down_combine_fp8(act, ids, weights, quant[2], quant[3], block)
    assert act.dtype == dtype and out.dtype == dtype and out.shape == (t, h)
    ref_act, ref_out = _reference(x, w13, w2, ids, weights, dtype)
    eps = UNIT_ROUNDOFF[dtype]
    for got, ref in ((act, ref_act), (out, ref_out)):
        bound = 4 * eps * ref.abs().max().item()
        torch.testing.assert_close(got.double(), ref, rtol=4 * eps, atol=bound)


@pytest.mark.parametrize("shape,t", [((128, 2048, 768), 1), ((8, 4096, 14336), 2)])
def test_agrees_with_the_triton_fp8_path(shape, t):
    e, h, i = shape
    quant, _ = _experts(e, h, i, None)
    k = 8 if e >= 8 else 2
    ids, weights = _routing(t, k, e, seed=3)
    x = torch.randn(t, h, device="cuda").bfloat16()
    act = ops.moe_decode_gate_up_fp8(x, ids, quant[0], quant[1])
    out = ops.moe_decode_down_combine_fp8(act, ids, weights, quant[2], quant[3])
    tri = triton_moe_fp8.fused_experts_triton_fp8(x, *quant, weights, ids, w8a8=False)
    scale = tri.float().abs().max().item()
    torch.testing.assert_close(out.float(), tri.float(), rtol=0, atol=2**-6 * scale)


def test_ids_out_of_range_add_nothing():
    e, h, i = 4, 64, 48
    quant, (w13, w2) = _experts(e, h, i, None)
    ids = torch.tensor([[1, -1], [e, 2]], dtype=torch.int32, device="cuda")
    weights = torch.full((2, 2), 0.5, device="cuda")
    x = torch.randn(2, h, device="cuda").bfloat16()
    act = ops.moe_decode_gate_up_fp8(x, ids, quant[0], quant[1])
    assert (act[1] == 0).all() and (act[2] == 0).all()  # slots 1 and 2: no expert
    out = ops.moe_decode_down_combine_fp8(act, ids, weights, quant[2], quant[3])
    valid = torch.tensor([[1, 0], [0, 2]], dtype=torch.int32, device="cuda")
    _, ref = _reference(x, w13, w2, valid, weights * torch.tensor([[1, 0], [0, 1]], device="cuda"),
                        torch.bfloat16)  # fmt: skip
    torch.testing.assert_close(out.double(), ref, rtol=2**-6, atol=2**-6 * ref.abs().max().item())


def test_graph_replay_follows_new_inputs():
    e, h, i = 128, 2048, 768
    quant, _ = _experts(e, h, i, None)
    scales = (quant[1].clone(), quant[3].clone())
    ids, weights = _routing(1, 8, e, seed=5)
    x = torch.randn(1, h, device="cuda").bfloat16()

    def step():
        act = ops.moe_decode_gate_up_fp8(x, ids, quant[0], scales[0])
        return ops.moe_decode_down_combine_fp8(act, ids, weights, quant[2], scales[1])

    step()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    ids2, weights2 = _routing(1, 8, e, seed=6)
    ids.copy_(ids2)
    weights.copy_(weights2)
    x.copy_(torch.randn(1, h, device="cuda").bfloat16())
    scales[0].mul_(0.5)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, step())


def test_fused_moe_layer_takes_them_for_decode_steps(monkeypatch):
    calls = []
    real = ops.moe_decode_gate_up_fp8

    def spy(x, *args, **kw):
        calls.append(x.shape[0])
        return real(x, *args, **kw)

    monkeypatch.setattr(ops, "moe_decode_gate_up_fp8", spy)
    monkeypatch.setattr(experts, "MOE_DECODE_MAX_SLOTS", 8)
    e, h, i = 128, 2048, 768
    with torch.device("cuda"):
        layer = FusedMoE(e, 8, h, i, renormalize=True, quant_config=Fp8Config(None, False))
    quant, _ = _experts(e, h, i, None)
    layer.w13_weight.data, layer.w13_weight_scale.data = quant[0], quant[1]
    layer.w2_weight.data, layer.w2_weight_scale.data = quant[2], quant[3]
    for t in (1, 2):  # 8 slots: the decode kernels; 16: the Triton path
        x = torch.randn(t, h, device="cuda").bfloat16()
        logits = torch.randn(t, e, device="cuda").bfloat16()
        out = layer(x, logits)
        weights, ids = select_experts(logits, 8, "softmax", True)
        tri = triton_moe_fp8.fused_experts_triton_fp8(x, *quant, weights, ids, w8a8=False)
        scale = tri.float().abs().max().item()
        torch.testing.assert_close(out.float(), tri.float(), rtol=0, atol=2**-6 * scale)
    assert calls == [1]


def test_binding_checks():
    e, h, i = 4, 64, 48
    quant, _ = _experts(e, h, i, None)
    ids, _ = _routing(1, 2, e, seed=0)
    x = torch.randn(1, h, device="cuda").bfloat16()
    with pytest.raises(ValueError, match="w13_scale"):
        ops.moe_decode_gate_up_fp8(x, ids, quant[0], quant[1][:, :-1])
    with pytest.raises(ValueError, match="block_k"):
        ops.moe_decode_gate_up_fp8(x, ids, quant[0], quant[1], (16, 8))
    with pytest.raises(TypeError, match="float8_e4m3fn"):
        ops.moe_decode_gate_up_fp8(x, ids, quant[0].bfloat16(), quant[1])
