"""The MoE layer's torch path against a float64 reference: routing (softmax / sigmoid,
renormalised or not, ties), experts with no token, one token and many, the grouping of slots
by expert, FP8 (emulated) experts."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from moe_utils import reference_moe

from pydaemon.layers.moe import FusedMoE, experts
from pydaemon.layers.moe.align import moe_align_native
from pydaemon.layers.moe.router import select_experts, select_experts_native
from pydaemon.quantization.config import Fp8Config
from pydaemon.quantization.fp8 import dequantize, quantize_per_channel, quantize_per_token

E, H, INTER = 8, 32, 48


def _layer(top_k: int, scoring="softmax", renormalize=False, seed=0, quant=None) -> FusedMoE:
    layer = FusedMoE(
        E, top_k, H, INTER, renormalize=renormalize, scoring=scoring, quant_config=quant
    )
    g = torch.Generator().manual_seed(seed)
    w13 = torch.randn(E, 2 * INTER, H, generator=g) * 0.2
    w2 = torch.randn(E, H, INTER, generator=g) * 0.2
    if quant is None:
        layer.w13_weight.data.copy_(w13)
        layer.w2_weight.data.copy_(w2)
    else:
        for wq_param, scale_param, w in (
            (layer.w13_weight, layer.w13_weight_scale, w13),
            (layer.w2_weight, layer.w2_weight_scale, w2),
        ):
            for e in range(E):
                wq, scale = quantize_per_channel(w[e])
                wq_param.data[e].copy_(wq)
                scale_param.data[e].copy_(scale)
    return layer


def _weights(layer: FusedMoE) -> tuple[torch.Tensor, torch.Tensor]:
    if layer.quant_method is None:
        return layer.w13_weight, layer.w2_weight
    w13 = torch.stack(
        [dequantize(layer.w13_weight[e], layer.w13_weight_scale[e]) for e in range(E)]
    )
    w2 = torch.stack([dequantize(layer.w2_weight[e], layer.w2_weight_scale[e]) for e in range(E)])
    return w13, w2


@pytest.mark.parametrize(
    "top_k,scoring,renormalize",
    [(2, "softmax", True), (2, "softmax", False), (3, "sigmoid", True), (1, "sigmoid", False)],
)
def test_layer_matches_float64_reference(top_k, scoring, renormalize):
    layer = _layer(top_k, scoring, renormalize)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(37, H, generator=g)
    logits = torch.randn(37, E, generator=g) * 2
    out = layer(x, logits)
    ref = reference_moe(x, layer.w13_weight, layer.w2_weight, logits, top_k, scoring, renormalize)
    assert out.dtype == torch.float32 and out.shape == (37, H)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)


def test_experts_with_no_one_and_many_tokens():
    """Expert 0 gets every token, expert 5 exactly one, experts 1-4, 6, 7 none but 3."""
    layer = _layer(2, renormalize=True)
    t = 20
    logits = torch.full((t, E), -5.0)
    logits[:, 0] = 4.0
    logits[:, 3] = 1.0
    logits[7, 5] = 3.0  # token 7: experts 0 and 5
    x = torch.randn(t, H, generator=torch.Generator().manual_seed(2))
    weights, ids = select_experts(logits, 2, "softmax", True)
    _, _, offsets = moe_align_native(ids, E)
    counts = torch.diff(offsets, prepend=offsets.new_zeros(1)).tolist()
    assert counts == [t, 0, 0, t - 1, 0, 1, 0, 0]
    ref = reference_moe(x, layer.w13_weight, layer.w2_weight, logits, 2, "softmax", True)
    torch.testing.assert_close(layer(x, logits).double(), ref, rtol=1e-5, atol=1e-5)


def test_routing_ties_pick_equal_experts():
    """Tied logits: experts 2 and 6 have the same weights, so the output does not depend on
    which of the two the tie picks; the weights of both picks are equal."""
    layer = _layer(2, renormalize=False)
    layer.w13_weight.data[6] = layer.w13_weight.data[2]
    layer.w2_weight.data[6] = layer.w2_weight.data[2]
    t = 9
    logits = torch.zeros(t, E)
    logits[:, 2] = logits[:, 6] = 1.5  # top-2 is {2, 6}, tied
    logits[::2, 4] = 1.5  # a three-way tie on even tokens: two of {2, 4, 6}
    layer.w13_weight.data[4] = layer.w13_weight.data[2]
    layer.w2_weight.data[4] = layer.w2_weight.data[2]
    weights, ids = select_experts_native(logits, 2)
    assert torch.equal(weights[:, 0], weights[:, 1])
    assert set(ids.flatten().tolist()) <= {2, 4, 6}
    x = torch.randn(t, H, generator=torch.Generator().manual_seed(3))
    ref = reference_moe(x, layer.w13_weight, layer.w2_weight, logits, 2)
    torch.testing.assert_close(layer(x, logits).double(), ref, rtol=1e-5, atol=1e-5)


def test_align_groups_slots_by_expert():
    g = torch.Generator().manual_seed(4)
    t, k = 33, 3
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(t)]).to(torch.int32)
    sorted_token_ids, inverse, offsets = moe_align_native(ids, E)
    assert sorted_token_ids.dtype == inverse.dtype == offsets.dtype == torch.int32
    assert offsets[-1].item() == t * k
    starts = [0, *offsets[:-1].tolist()]
    for e in range(E):
        rows = range(starts[e], offsets[e].item())
        assert sorted(sorted_token_ids[list(rows)].tolist()) == sorted(
            (ids == e).nonzero()[:, 0].tolist()
        )
    for s in range(t * k):  # slot s = (token s // k, its j-th expert) is row inverse[s]
        row = inverse[s].item()
        assert sorted_token_ids[row].item() == s // k
        assert starts[ids.flatten()[s]] <= row < offsets[ids.flatten()[s]]


@pytest.mark.parametrize("quant", [None, Fp8Config(None, emulate=True)])
def test_masked_path_of_graph_capture(monkeypatch, quant):
    """While a CUDA graph is captured the per-expert GEMMs cannot read the group bounds:
    every expert runs on all rows, masked. Same result as the per-group loop."""
    layer = _layer(3, renormalize=True, quant=quant)
    g = torch.Generator().manual_seed(6)
    x = torch.randn(11, H, generator=g)
    logits = torch.randn(11, E, generator=g)
    looped = layer(x, logits)
    monkeypatch.setattr(experts, "_no_host_reads", lambda t: True)
    torch.testing.assert_close(layer(x, logits), looped, rtol=1e-6, atol=1e-6)


def test_one_token():
    layer = _layer(2)
    x = torch.randn(1, H)
    logits = torch.randn(1, E)
    ref = reference_moe(x, layer.w13_weight, layer.w2_weight, logits, 2)
    torch.testing.assert_close(layer(x, logits).double(), ref, rtol=1e-5, atol=1e-5)


def _fp8_reference(x, w13, w2, logits, top_k) -> torch.Tensor:
    """reference_moe with the FP8 path's activation quantization: x per token, the
    SiLU-and-mul output per (token, expert) row; products in float64."""
    xq, xs = quantize_per_token(x)
    x_dq = xq.double() * xs.double()
    weights, ids = select_experts_native(logits, top_k, "softmax", True)
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float64)
    i = w2.shape[2]
    for t in range(x.shape[0]):
        for w, e in zip(weights[t].tolist(), ids[t].tolist(), strict=True):
            h = w13[e].double() @ x_dq[t]
            a = (F.silu(h[:i]) * h[i:]).float()[None]
            aq, a_scale = quantize_per_token(a)
            out[t] += w * (w2[e].double() @ (aq.double() * a_scale.double())[0])
    return out


def test_fp8_emulated_experts():
    """FP8 weights (per channel) and activations (per token, per row after SiLU): against a
    float64 reference that quantizes the activations the same way (a few values may round
    to the neighbouring e4m3 step); the unquantized reference is far off."""
    layer = _layer(2, renormalize=True, quant=Fp8Config(None, emulate=True))
    assert layer.w13_weight.dtype == torch.float8_e4m3fn
    g = torch.Generator().manual_seed(5)
    x = torch.randn(25, H, generator=g)
    logits = torch.randn(25, E, generator=g)
    w13, w2 = _weights(layer)
    ref = _fp8_reference(x, w13, w2, logits, 2)
    out = layer(x, logits).double()
    assert (out - ref).norm() / ref.norm() < 2e-3
    unquantized = reference_moe(x, w13, w2, logits, 2, renormalize=True)
    assert (out - unquantized).norm() / unquantized.norm() > 1e-2


def test_bad_arguments_are_clear_errors():
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        FusedMoE(4, 5, H, INTER, renormalize=True)
    with pytest.raises(ValueError, match="scoring"):
        FusedMoE(4, 2, H, INTER, renormalize=True, scoring="relu")
    with pytest.raises(ValueError, match="top_k"):
        select_experts(torch.zeros(2, 4), 0)
