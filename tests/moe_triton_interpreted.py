"""The Triton fused-MoE expert path (pydaemon/layers/moe/triton_moe.py) on the CPU under
Triton's interpreter (the kernels run in numpy on CPU tensors). Not collected by itself:
tests/test_moe_triton.py runs this file in a pytest subprocess with TRITON_INTERPRET=1 set
before anything imports triton (triton.language's own helpers are jitted when it is first
imported, so the switch cannot be flipped inside a process that already imported it).

What the interpreter does not show: the compiled kernels, the tensor cores (its tl.dot on
bf16 operands is broken, so the kernel converts them to float32 there: DOT_F32) and the
speed; tests/gpu/test_moe_triton_gpu.py covers those on CUDA.

Checked: the align (each slot once, by expert, padded per expert to BLOCK_M, blocks past the
end marked), the whole path against a float64 reference and the torch path (E 8 top-2 and
E 16 top-4; H 64, I 32, and an odd H 48, I 24 for masked K and N; T 1, 3, 17, 64; routing
ties, experts with no token, one token, every token), float32, bf16 and fp16, tile configs
with BLOCK_M 16, 32, 64, and the switch in experts.py."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from pydaemon.layers.moe import experts, triton_moe
from pydaemon.layers.moe.router import select_experts
from pydaemon.layers.moe.triton_moe import TileConfig

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("run by tests/test_moe_triton.py under TRITON_INTERPRET=1", allow_module_level=True)
pytest.importorskip("triton", reason="triton is not installed")
from pydaemon.layers.moe import triton_moe_kernels  # noqa: E402

CONFIGS = [TileConfig(16, 64, 128, 1, 4, 3), TileConfig(32, 32, 32, 2, 4, 2),
           TileConfig(64, 16, 16, 4, 4, 2)]  # fmt: skip


def test_the_kernels_are_interpreted():
    assert triton_moe_kernels.INTERPRETED


def _check_align(ids: torch.Tensor, e: int, block_m: int) -> None:
    sorted_slots, block_expert = triton_moe.moe_align_blocks(ids, e, block_m)
    flat = ids.reshape(-1)
    s = flat.numel()
    counts = torch.bincount(flat.long(), minlength=e)
    blocks = (-(-counts // block_m)).tolist()
    nb = sum(blocks)
    assert block_expert.numel() * block_m >= triton_moe.max_padded_rows(s, e, block_m)
    want_blocks = [x for x in range(e) for _ in range(blocks[x])]
    assert block_expert[:nb].tolist() == want_blocks
    assert (block_expert[nb:] == -1).all()
    rows = sorted_slots[: nb * block_m].view(nb, block_m)
    row = 0
    for x in range(e):
        got = rows[row : row + blocks[x]].reshape(-1)
        want = (flat == x).nonzero().flatten().tolist()  # slot order within an expert
        assert got[: len(want)].tolist() == want
        assert (got[len(want) :] == s).all()  # padding
        row += blocks[x]


@pytest.mark.parametrize("t,k,e", [(1, 2, 8), (3, 4, 16), (17, 2, 8), (64, 4, 16), (300, 8, 128),
                                   (1, 1, 4)])  # fmt: skip
@pytest.mark.parametrize("block_m", [16, 64])
def test_align_sorts_and_pads_slots_by_expert(t, k, e, block_m):
    g = torch.Generator().manual_seed(t * 31 + k)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]).to(torch.int32)
    _check_align(ids, e, block_m)


def test_align_every_token_on_the_same_experts():
    ids = torch.tensor([[3, 5]] * 40, dtype=torch.int32)  # 40 slots on two experts, 6 on none
    _check_align(ids, 8, 16)


def _logits(t: int, e: int, case: str, g: torch.Generator) -> torch.Tensor:
    logits = torch.randn(t, e, generator=g)
    if case == "ties":  # equal logits: the lower ids win (router), every row a tie somewhere
        logits = torch.zeros(t, e)
        logits[:, e // 2] = 1.0
        if t > 1:
            logits[1::2] = 0.5
    elif case == "crowded":  # every token on the same top experts, the others idle
        logits[:, 1] += 50.0
        logits[:, e - 1] += 40.0
    return logits


def _reference(x, w13, w2, weights, ids) -> torch.Tensor:  # [T, H] float64
    """Token by token in float64 from the given routing (CPU torch.topk breaks ties in its own
    way: the ids are whatever the router picked)."""
    x, w13, w2, weights = x.double(), w13.double(), w2.double(), weights.double()
    i = w2.shape[2]
    out = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float64)
    for t in range(x.shape[0]):
        for j, e in enumerate(ids[t].tolist()):
            h = w13[e] @ x[t]
            out[t] += weights[t, j] * (w2[e] @ (F.silu(h[:i]) * h[i:]))
    return out


def _weights(e: int, h: int, i: int, g: torch.Generator):
    return torch.randn(e, 2 * i, h, generator=g) * 0.2, torch.randn(e, h, i, generator=g) * 0.2


@pytest.mark.parametrize("e,k", [(8, 2), (16, 4)])
@pytest.mark.parametrize("t", [1, 3, 17, 64])
@pytest.mark.parametrize("case", ["random", "ties", "crowded"])
def test_float32_matches_float64_and_torch_path(e, k, t, case):
    g = torch.Generator().manual_seed(t + 7 * e)
    h, i = 64, 32
    x = torch.randn(t, h, generator=g)
    w13, w2 = _weights(e, h, i, g)
    logits = _logits(t, e, case, g)
    weights, ids = select_experts(logits, k, "softmax", True)
    out = triton_moe.fused_experts_triton(x, w13, w2, weights, ids)
    assert out.dtype == torch.float32 and out.shape == (t, h)
    ref = _reference(x, w13, w2, weights, ids)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out, experts.fused_experts(x, w13, w2, weights, ids),
                               rtol=1e-5, atol=1e-5)  # fmt: skip


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: f"bm{c.block_m}")
@pytest.mark.parametrize("h,i", [(64, 32), (48, 24)])
def test_tile_configs_and_odd_sizes(cfg, h, i):
    """BLOCK_M 16 / 32 / 64 (padding), BLOCK_N and BLOCK_K smaller than N and K (several
    tiles, the K loop) and sizes that are not multiples of the tiles (masked K and N)."""
    e, k, t = 16, 4, 17
    g = torch.Generator().manual_seed(h + cfg.block_m)
    x = torch.randn(t, h, generator=g)
    w13, w2 = _weights(e, h, i, g)
    logits = torch.randn(t, e, generator=g)
    weights, ids = select_experts(logits, k, "softmax", False)
    out = triton_moe.fused_experts_triton(x, w13, w2, weights, ids, config=cfg)
    ref = _reference(x, w13, w2, weights, ids)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("e,k,t", [(8, 2, 1), (8, 2, 17), (16, 4, 3), (16, 4, 64)])
def test_half_precision_near_the_torch_path(dtype, e, k, t):
    """bf16 / fp16 in and out (float32 products in the interpreter): within a few roundings of
    the float64 reference, no farther from it than the torch path's roundings allow."""
    g = torch.Generator().manual_seed(t + e)
    h, i = 64, 32
    x = torch.randn(t, h, generator=g).to(dtype)
    w13, w2 = (w.to(dtype) for w in _weights(e, h, i, g))
    logits = torch.randn(t, e, generator=g)
    weights, ids = select_experts(logits, k, "softmax", True)
    out = triton_moe.fused_experts_triton(x, w13, w2, weights, ids)
    assert out.dtype == dtype
    ref = _reference(x, w13, w2, weights, ids)
    torch_path = experts.fused_experts(x, w13, w2, weights, ids)
    eps = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}[dtype]
    scale = ref.abs().max().item()
    err = (out.double() - ref).abs().max().item()
    torch_err = (torch_path.double() - ref).abs().max().item()
    assert err <= max(2 * torch_err, 4 * eps * scale), (err, torch_err, scale)
    torch.testing.assert_close(out.float(), torch_path.float(), rtol=0, atol=8 * eps * scale)


def _reference_swiglu_oai(x, w13, w2, b13, b2, weights, ids, alpha, limit) -> torch.Tensor:
    """gpt-oss's experts token by token in float64 (transformers' GptOssExperts, on the
    de-interleaved [gate | up] halves)."""
    x, w13, w2, b13, b2 = (a.double() for a in (x, w13, w2, b13, b2))
    i = w2.shape[2]
    out = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float64)
    for t in range(x.shape[0]):
        for j, e in enumerate(ids[t].tolist()):
            h = w13[e] @ x[t] + b13[e]
            gate, up = h[:i].clamp(max=limit), h[i:].clamp(-limit, limit)
            act = (up + 1) * gate * torch.sigmoid(gate * alpha)
            out[t] += weights[t, j].double() * (w2[e] @ act + b2[e])
    return out


@pytest.mark.parametrize("t", [1, 17])
def test_biases_and_clamped_swiglu_match_float64(t):
    """gpt-oss: expert biases and the clamped SwiGLU, on the Triton path and the grouped torch
    path, against float64; the clamp (limit 0.5) bites on these activations."""
    from pydaemon.layers.moe.activation import MoeActivation

    e, k, h, i = 8, 2, 64, 32
    g = torch.Generator().manual_seed(t)
    x = torch.randn(t, h, generator=g)
    w13, w2 = _weights(e, h, i, g)
    b13, b2 = torch.randn(e, 2 * i, generator=g) * 0.3, torch.randn(e, h, generator=g) * 0.3
    weights, ids = select_experts(torch.randn(t, e, generator=g), k, "softmax", True)
    act = MoeActivation("swigluoai", 1.702, 0.5)
    ref = _reference_swiglu_oai(x, w13, w2, b13, b2, weights, ids, 1.702, 0.5)
    out = triton_moe.fused_experts_triton(
        x, w13, w2, weights, ids, activation=act, w13_bias=b13, w2_bias=b2
    )
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    grouped = experts.fused_experts(x, w13, w2, weights, ids, act, b13, b2)
    torch.testing.assert_close(grouped.double(), ref, rtol=1e-5, atol=1e-5)
    plain = experts.fused_experts(x, w13, w2, weights, ids)
    assert (plain - grouped).abs().max() > 1e-2  # the biases and the clamp matter here


def test_deterministic_and_empty():
    g = torch.Generator().manual_seed(5)
    x = torch.randn(33, 64, generator=g).to(torch.bfloat16)
    w13, w2 = (w.to(torch.bfloat16) for w in _weights(8, 64, 32, g))
    weights, ids = select_experts(torch.randn(33, 8, generator=g), 2, "softmax", True)
    a = triton_moe.fused_experts_triton(x, w13, w2, weights, ids)
    assert torch.equal(a, triton_moe.fused_experts_triton(x, w13, w2, weights, ids))
    empty = triton_moe.fused_experts_triton(x[:0], w13, w2, weights[:0], ids[:0])
    assert empty.shape == (0, 64)


def test_switch_routes_fused_experts_to_triton(monkeypatch):
    """MOE_BACKEND = "triton" sends steps of at most MOE_TRITON_MAX_TOKENS tokens to the Triton
    path where it can serve them (CUDA only: here ``supports`` is forced to say yes)."""
    calls = []
    real = triton_moe.fused_experts_triton

    def spy(*args, **kwargs):
        calls.append(args[0].shape[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(triton_moe, "fused_experts_triton", spy)
    g = torch.Generator().manual_seed(2)
    w13, w2 = _weights(8, 64, 32, g)
    for t in (3, 40):
        x = torch.randn(t, 64, generator=g)
        weights, ids = select_experts(torch.randn(t, 8, generator=g), 2, "softmax", True)
        experts.fused_experts(x, w13, w2, weights, ids)  # default: grouped
        assert not calls
        assert not experts.use_triton(x, w13, w2)  # the CPU: not served
    monkeypatch.setattr(experts, "MOE_BACKEND", "triton")
    monkeypatch.setattr(experts, "MOE_TRITON_MAX_TOKENS", 16)
    monkeypatch.setattr(triton_moe, "supports", lambda *a: True)
    for t in (3, 40):
        x = torch.randn(t, 64, generator=g)
        weights, ids = select_experts(torch.randn(t, 8, generator=g), 2, "softmax", True)
        out = experts.fused_experts(x, w13, w2, weights, ids)
        torch.testing.assert_close(out, _torch_path(x, w13, w2, weights, ids, monkeypatch))
    assert calls == [3]  # 40 tokens > MOE_TRITON_MAX_TOKENS: grouped


def _torch_path(x, w13, w2, weights, ids, monkeypatch):
    with monkeypatch.context() as m:
        m.setattr(experts, "MOE_BACKEND", "grouped")
        return experts.fused_experts(x, w13, w2, weights, ids)
