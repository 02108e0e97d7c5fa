"""The Triton fused-MoE expert path (pydaemon/layers/moe/triton_moe.py) on CUDA: against the
grouped path (align, torch._grouped_mm, silu_and_mul, combine) and a float32 reference on the
Qwen3-30B-A3B expert shape (E 128, top-8, H 2048, I 768) in bf16 at T = 1, 8, 64, 256, 1024
(fp16 at one size), every tile config of the table compiled and run on the device, replay
from a CUDA graph after x, the routing and the weights changed in place (bitwise equal to an
eager call), and the switch in experts.py (MOE_BACKEND) sending FusedMoE steps to it."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

from pydaemon import ops
from pydaemon.layers.moe import FusedMoE, experts, triton_moe
from pydaemon.layers.moe.router import select_experts

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available()
    or not ops.moe_kernels_available()
    or triton_moe.triton_unavailable_reason() is not None,
    reason="needs a CUDA GPU, pagedd's MoE kernels and triton",
)

E, K, H, INTER = 128, 8, 2048, 768  # Qwen3-30B-A3B's experts
TOKENS = [1, 8, 64, 256, 1024]


@functools.cache
def _weights(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(0)
    w13 = torch.randn(E, 2 * INTER, H, device="cuda", generator=g) * 0.02
    w2 = torch.randn(E, H, INTER, device="cuda", generator=g) * 0.02
    return w13.to(dtype), w2.to(dtype)


def _inputs(t: int, dtype: torch.dtype, seed: int, skew: bool = False):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(t, H, device="cuda", generator=g).to(dtype)
    logits = torch.randn(t, E, device="cuda", generator=g)
    if skew:  # every token on the same 8 experts: long segments, 120 experts idle
        logits[:, 8:] -= 100.0
    weights, ids = select_experts(logits.to(dtype), K, "softmax", True)
    return x, weights, ids


def _grouped(x, w13, w2, weights, ids, monkeypatch) -> torch.Tensor:
    with monkeypatch.context() as m:
        m.setattr(experts, "MOE_BACKEND", "grouped")
        m.setattr(experts, "MOE_DECODE_MAX_SLOTS", 0)
        return experts.fused_experts(x, w13, w2, weights, ids)


def _reference(x, w13, w2, weights, ids) -> torch.Tensor:  # [T, H] float32
    out = torch.zeros(x.shape[0], H, device="cuda")
    for e in ids.unique().tolist():
        tok, j = (ids == e).nonzero(as_tuple=True)
        h = x[tok].float() @ w13[e].float().T
        y = (F.silu(h[:, :INTER]) * h[:, INTER:]) @ w2[e].float().T
        out.index_add_(0, tok, y * weights[tok, j, None])
    return out


@pytest.mark.parametrize("skew", [False, True])
@pytest.mark.parametrize("t", TOKENS)
def test_bf16_matches_the_grouped_path(monkeypatch, t, skew):
    w13, w2 = _weights(torch.bfloat16)
    x, weights, ids = _inputs(t, torch.bfloat16, seed=t, skew=skew)
    out = triton_moe.fused_experts_triton(x, w13, w2, weights, ids)
    assert out.dtype == torch.bfloat16 and out.shape == (t, H)
    grouped = _grouped(x, w13, w2, weights, ids, monkeypatch)
    ref = _reference(x, w13, w2, weights, ids)
    scale = ref.abs().max().item()
    err = (out.float() - ref).abs().max().item()
    grouped_err = (grouped.float() - ref).abs().max().item()
    # the same roundings (h, the activations, each slot's output, the sum) in another order
    assert err <= max(2 * grouped_err, 2**-7 * scale), (err, grouped_err, scale)
    torch.testing.assert_close(out.float(), grouped.float(), rtol=0, atol=2**-6 * scale)
    mean = (out.float() - grouped.float()).abs().mean().item()
    assert mean <= 2**-8 * scale, (mean, scale)


def test_fp16_matches_the_grouped_path(monkeypatch):
    w13, w2 = _weights(torch.float16)
    x, weights, ids = _inputs(64, torch.float16, seed=3)
    out = triton_moe.fused_experts_triton(x, w13, w2, weights, ids)
    ref = _reference(x, w13, w2, weights, ids)
    scale = ref.abs().max().item()
    assert (out.float() - ref).abs().max().item() <= 2**-8 * scale


@pytest.mark.parametrize("index", range(len(triton_moe.TILE_CONFIGS)))
def test_every_tile_config_runs_on_the_device(index):
    """Each config of the table compiles (registers, shared memory) and gives the same result
    within roundings, at a size with several blocks per expert and idle experts."""
    cfg = triton_moe.TILE_CONFIGS[index][1]
    w13, w2 = _weights(torch.bfloat16)
    x, weights, ids = _inputs(300, torch.bfloat16, seed=11, skew=False)
    out = triton_moe.fused_experts_triton(x, w13, w2, weights, ids, config=cfg)
    ref = _reference(x, w13, w2, weights, ids)
    scale = ref.abs().max().item()
    assert (out.float() - ref).abs().max().item() <= 2**-7 * scale


@pytest.mark.parametrize("t", TOKENS)
def test_cuda_graph_replay_follows_new_routing(t):
    w13, w2 = _weights(torch.bfloat16)
    x, weights, ids = _inputs(t, torch.bfloat16, seed=100 + t)

    def step():
        return triton_moe.fused_experts_triton(x, w13, w2, weights, ids)

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()  # compiles outside the capture
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for seed, skew in ((200 + t, False), (300 + t, True)):
        x2, weights2, ids2 = _inputs(t, torch.bfloat16, seed=seed, skew=skew)
        x.copy_(x2)
        weights.copy_(weights2)
        ids.copy_(ids2)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, step())


def test_fused_moe_layer_takes_the_triton_path(monkeypatch):
    """MOE_BACKEND = "triton": FusedMoE steps above the decode kernels' bound run the Triton
    path (one token of a top-8 model stays on the decode kernels)."""
    calls = []
    real = triton_moe.fused_experts_triton

    def spy(*args, **kwargs):
        calls.append(args[0].shape[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(triton_moe, "fused_experts_triton", spy)
    torch.manual_seed(0)
    with torch.device("cuda"):
        layer = FusedMoE(E, K, H, INTER, renormalize=True)
    layer.w13_weight.data, layer.w2_weight.data = _weights(torch.bfloat16)
    for t in (1, 64):
        x, _, _ = _inputs(t, torch.bfloat16, seed=t)
        logits = torch.randn(t, E, device="cuda").to(torch.bfloat16)
        grouped = layer(x, logits)
        monkeypatch.setattr(experts, "MOE_BACKEND", "triton")
        out = layer(x, logits)
        monkeypatch.setattr(experts, "MOE_BACKEND", "grouped")
        scale = grouped.float().abs().max().item()
        torch.testing.assert_close(out.float(), grouped.float(), rtol=0, atol=2**-6 * scale)
    assert calls == ([64] if ops.moe_decode_kernels_available() else [1, 64])
