"""The MoE decode kernels (moe_decode_gate_up, moe_decode_down_combine: cpp/cuda/
moe_decode_kernels.cu) against float64 references on fresh random inputs, against the unfused
path (align, grouped GEMMs, silu_and_mul, combine), the whole FusedMoE layer with the decode
switch on and off, replay from a CUDA graph after x, the expert ids and the weights changed in
place, expert ids out of range, and the binding's argument checks.

The references carry the roundings the kernels make on purpose (gate and up and each expert's
output rounded to the dtype, as a grouped GEMM stores them; silu_and_mul's) in float64, so
nearly every element is the reference rounded once. Where a float32 sum landed on the other
side of a rounding boundary than the float64 one, an intermediate value is one ulp off: those
few elements are bounded by a few unit roundoffs of the terms' size (``scale``).

Shapes: Qwen3-30B-A3B's experts (H 2048, I 768), Mixtral-8x7B's (4096, 14336; 8 experts),
tiny ones; H 40 / I 36 and H 36 / I 20 take the scalar (non-16-byte) paths.
"""

from __future__ import annotations

import functools

import pytest
import torch

from pydaemon import ops
from pydaemon.layers.moe import FusedMoE, experts

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or not ops.moe_decode_kernels_available(),
    reason="needs a CUDA GPU and pagedd's MoE decode kernels",
)

DTYPES = [torch.bfloat16, torch.float16]
UNIT_ROUNDOFF = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}
# (num_experts, hidden, intermediate)
SHAPES = [
    (8, 2048, 768),
    (128, 2048, 768),
    (8, 4096, 14336),
    (8, 64, 32),
    (128, 64, 32),
    (8, 40, 36),
    (8, 36, 20),
]
DECODE_SLOTS = 64  # MOE_DECODE_MAX_SLOTS while a test turns the decode path on


@pytest.fixture
def decode_on(monkeypatch):
    monkeypatch.setattr(experts, "MOE_DECODE_MAX_SLOTS", DECODE_SLOTS)


@functools.lru_cache(maxsize=4)
def _weights(e: int, h: int, i: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """w13 [E, 2I, H], w2 [E, H, I] with rows of norm ~1: gate, up and outputs of order 1."""
    g = torch.Generator(device="cuda").manual_seed(e * 7919 + h * 31 + i)
    w13 = (torch.randn(e, 2 * i, h, device="cuda", generator=g) * h**-0.5).to(dtype)
    w2 = (torch.randn(e, h, i, device="cuda", generator=g) * i**-0.5).to(dtype)
    return w13, w2


def _routing(t: int, k: int, e: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [T, k] int32 (distinct within a token; token 1 reuses token 0's experts in reverse
    order), weights [T, k] float32 (positive, summing to 1)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    if t > 1:
        ids[1] = ids[0].flip(0)
    weights = torch.randn(t, k, generator=g).softmax(-1)
    return ids.to("cuda", torch.int32), weights.cuda()


def _per_expert(a: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """float64 [S, N]: a[s] @ w[ids[s]].T for rows a [S, K], ids [S], w [E, N, K]; one
    product per distinct expert (no [S, N, K] gather)."""
    out = torch.empty(a.shape[0], w.shape[1], dtype=torch.float64, device=a.device)
    for e in ids.unique().tolist():
        rows = ids == e
        out[rows] = a[rows].double() @ w[e].double().T
    return out


def _float32_error(n: int) -> float:
    """Bound on the relative error (of the sum of |terms|) of the kernels' float32 dot
    products of n terms: n / 32 terms in turn per lane, then 5 steps over the warp."""
    return (n / 32 + 5) * 2.0**-24


def reference_gate_up(x, ids, w13, dtype) -> tuple[torch.Tensor, ...]:
    """(act before its last rounding, scale, slack) float64 [T * k, I]: g and u rounded to
    dtype, silu(g) rounded, times u. scale: the size a one-ulp change of g, u or silu(g)
    moves act by (|u| (|silu(g)| + |g silu'(g)|)); slack: what the float32 sums' error in g
    and u moves it by (it matters where g or u nearly cancels: fp16's subnormals)."""
    t, k = ids.shape
    i = w13.shape[1] // 2
    tokens = torch.arange(t, device=x.device).repeat_interleave(k)
    flat = ids.reshape(-1).long()
    h = _per_expert(x[tokens], flat, w13)
    terms = _per_expert(x[tokens].abs(), flat, w13.abs()) * _float32_error(x.shape[1])
    g, u = h[:, :i], h[:, i:]
    g_r, u_r = g.to(dtype).double(), u.to(dtype).double()
    silu_r = (g_r * torch.sigmoid(g_r)).to(dtype).double()
    sig = torch.sigmoid(g)
    dsilu = sig * (1 + g * (1 - sig))
    scale = u.abs() * ((g * sig).abs() + (g * dsilu).abs())
    slack = 2 * (dsilu.abs() * u.abs() * terms[:, :i] + (g * sig).abs() * terms[:, i:])
    return silu_r * u_r, scale, slack


def reference_down_combine(act, ids, weights, w2, dtype) -> tuple[torch.Tensor, ...]:
    """(out before its last rounding, scale, slack) float64 [T, H]: each expert's output
    rounded to dtype, the weighted sum over j in float64. scale = sum_j |w_j y_j|; slack: the
    float32 sums' error in the y_j, weighted."""
    t, k = ids.shape
    flat = ids.reshape(-1).long()
    y = _per_expert(act, flat, w2)  # [T * k, H]
    terms = _per_expert(act.abs(), flat, w2.abs()) * _float32_error(act.shape[1])
    w = weights.double().reshape(-1, 1)
    ref = (y.to(dtype).double() * w).view(t, k, -1).sum(1)
    scale = (y.abs() * w.abs()).view(t, k, -1).sum(1)
    slack = 2 * (terms * w.abs()).view(t, k, -1).sum(1)
    return ref, scale, slack


def assert_rounded_once(out, ref, scale, slack, dtype):
    """out (dtype) is ref rounded once (to within the float32 sums' slack), but for a few
    elements whose intermediate value a float32 sum rounded the other way: those stay within a
    few unit roundoffs of scale."""
    u = UNIT_ROUNDOFF[dtype]
    err = (out.double() - ref).abs()
    once = err <= u * ref.abs() * (1 + 1e-3) + 1e-2 * u * scale + slack + 1e-7
    num_off = (~once).sum().item()
    assert num_off <= 2 + 0.01 * once.numel(), f"{num_off} of {once.numel()} not rounded once"
    bound = u * ref.abs() + 3 * u * scale + slack + 1e-7
    excess = (err - bound).max().item()
    assert excess <= 0, f"max error above the bound by {excess}"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("e,h,i", SHAPES)
@pytest.mark.parametrize("k", [1, 2, 8])
@pytest.mark.parametrize("t", [1, 2, 4, 8])
def test_kernels_against_float64(t, k, e, h, i, dtype):
    w13, w2 = _weights(e, h, i, dtype)
    ids, weights = _routing(t, k, e, seed=t * 100 + k)
    x = torch.randn(t, h, device="cuda").to(dtype)

    act = ops.moe_decode_gate_up(x, ids, w13)
    assert act.shape == (t * k, i) and act.dtype == dtype
    assert_rounded_once(act, *reference_gate_up(x, ids, w13, dtype), dtype)

    out = ops.moe_decode_down_combine(act, ids, weights, w2)
    assert out.shape == (t, h) and out.dtype == dtype
    assert_rounded_once(out, *reference_down_combine(act, ids, weights, w2, dtype), dtype)


def test_strided_rows_of_x():
    """x with a row stride larger than H (a view into a wider buffer) reads the right rows."""
    e, h, i, t, k = 8, 2048, 768, 4, 2
    w13, _ = _weights(e, h, i, torch.bfloat16)
    ids, _ = _routing(t, k, e, seed=5)
    wide = torch.randn(t, h + 64, device="cuda").bfloat16()
    x = wide[:, 8 : 8 + h]
    assert not x.is_contiguous()
    strided = ops.moe_decode_gate_up(x, ids, w13)
    assert torch.equal(strided, ops.moe_decode_gate_up(x.contiguous(), ids, w13))


def test_expert_ids_out_of_range_read_nothing():
    """An id outside [0, E) gives a zero act row and adds nothing to its token's output."""
    e, h, i, t, k = 8, 256, 128, 3, 2
    dtype = torch.bfloat16
    w13, w2 = _weights(e, h, i, dtype)
    ids, weights = _routing(t, k, e, seed=9)
    bad = torch.tensor([[0, 1], [1, 0], [0, 0]], dtype=torch.bool, device="cuda")
    ids_bad = torch.where(bad, torch.tensor([-1, e], device="cuda", dtype=torch.int32), ids)
    x = torch.randn(t, h, device="cuda").to(dtype)
    act = ops.moe_decode_gate_up(x, ids_bad, w13)
    assert torch.count_nonzero(act[bad.reshape(-1)]) == 0
    good = ~bad.reshape(-1)
    assert torch.equal(act[good], ops.moe_decode_gate_up(x, ids, w13)[good])
    out = ops.moe_decode_down_combine(act, ids_bad, weights, w2)
    assert_rounded_once(out, *reference_down_combine(act, ids, weights * ~bad, w2, dtype), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("e,h,i", [(128, 2048, 768), (8, 4096, 14336), (8, 64, 32)])
@pytest.mark.parametrize("t,k", [(1, 8), (4, 2), (8, 8)])
def test_fused_experts_decode_matches_unfused(monkeypatch, t, k, e, h, i, dtype):
    """fused_experts with the decode kernels against its unfused path (MOE_DECODE_MAX_SLOTS
    0): the same roundings, a different summation order (bf16: torch._grouped_mm; fp16: one
    F.linear per expert)."""
    w13, w2 = _weights(e, h, i, dtype)
    ids, weights = _routing(t, k, e, seed=t + k)
    x = torch.randn(t, h, device="cuda").to(dtype)
    monkeypatch.setattr(experts, "MOE_DECODE_MAX_SLOTS", 0)
    assert not experts.use_decode_kernels(x, w13, ids)
    unfused = experts.fused_experts(x, w13, w2, weights, ids)
    monkeypatch.setattr(experts, "MOE_DECODE_MAX_SLOTS", DECODE_SLOTS)
    assert experts.use_decode_kernels(x, w13, ids)
    decode = experts.fused_experts(x, w13, w2, weights, ids)
    # fp16: cuBLAS may add split-K partial sums in fp16, a few roundings more than ours.
    u = UNIT_ROUNDOFF[dtype]
    rel = ((decode.double() - unfused.double()).norm() / unfused.double().norm()).item()
    assert rel < 4 * u, rel
    torch.testing.assert_close(decode, unfused, rtol=4 * u, atol=8 * u * unfused.abs().max().item())


def _layer(e: int, k: int, h: int, i: int) -> FusedMoE:
    with torch.device("cuda"):
        layer = FusedMoE(e, k, h, i, renormalize=True)
    w13, w2 = _weights(e, h, i, torch.bfloat16)
    layer.w13_weight.data = w13
    layer.w2_weight.data = w2
    return layer


@pytest.mark.parametrize("t", [1, 4, 8, 9])
def test_layer_with_the_switch_on_and_off(monkeypatch, t):
    """The Qwen3-30B-A3B-shaped FusedMoE layer (bf16) with the decode kernels against without;
    9 tokens x top-8 = 72 slots is above the switch: the unfused path both times."""
    e, k, h, i = 128, 8, 2048, 768
    layer = _layer(e, k, h, i)
    x = torch.randn(t, h, device="cuda").bfloat16()
    logits = torch.randn(t, e, device="cuda").bfloat16()
    monkeypatch.setattr(experts, "MOE_DECODE_MAX_SLOTS", 0)
    off = layer(x, logits)
    calls = []
    gate_up = ops.moe_decode_gate_up
    monkeypatch.setattr(ops, "moe_decode_gate_up", lambda *a: calls.append(1) or gate_up(*a))
    monkeypatch.setattr(experts, "MOE_DECODE_MAX_SLOTS", DECODE_SLOTS)
    on = layer(x, logits)
    assert len(calls) == (1 if t * k <= DECODE_SLOTS else 0)
    if not calls:  # the same path (rows within an expert's group may sit elsewhere)
        torch.testing.assert_close(on, off)
        return
    u = UNIT_ROUNDOFF[torch.bfloat16]
    rel = ((on.double() - off.double()).norm() / off.double().norm()).item()
    assert rel < 2 * u, rel


@pytest.mark.parametrize("dtype", DTYPES)
def test_replays_from_a_cuda_graph_after_inputs_change(decode_on, dtype):
    """Captured once, replayed after x, the expert ids and the weights changed in place: the
    same output as an eager call on the new inputs, bit for bit (no atomics, fixed order)."""
    e, h, i, t, k = 128, 2048, 768, 4, 8
    w13, w2 = _weights(e, h, i, dtype)
    ids, weights = _routing(t, k, e, seed=1)
    x = torch.randn(t, h, device="cuda").to(dtype)
    assert experts.use_decode_kernels(x, w13, ids)
    with torch.inference_mode():
        experts.fused_experts(x, w13, w2, weights, ids)  # warm-up outside the graph
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = experts.fused_experts(x, w13, w2, weights, ids)
        new_ids, new_weights = _routing(t, k, e, seed=2)
        ids.copy_(new_ids)
        weights.copy_(new_weights)
        x.copy_(torch.randn(t, h, device="cuda").to(dtype))
        graph.replay()
        eager = experts.fused_experts(x, w13, w2, weights, ids)
    assert torch.equal(out, eager)
    ref_act = reference_gate_up(x, ids, w13, dtype)[0]
    ref = reference_down_combine(ref_act.to(dtype), ids, weights, w2, dtype)[0]
    err = ((out.double() - ref).norm() / ref.norm()).item()
    assert err < 2 * UNIT_ROUNDOFF[dtype], err  # the new routing, not the captured one


def _call_gate_up(act, x, ids, w13):
    ops.core().moe_decode_gate_up(act, x, ids, w13, torch.cuda.current_stream().cuda_stream)


def _call_down(out, act, ids, weights, w2):
    ops.core().moe_decode_down_combine(
        out, act, ids, weights, w2, torch.cuda.current_stream().cuda_stream
    )


def test_bad_arguments_raise_clear_errors():
    e, h, i, t, k = 8, 64, 32, 2, 2
    w13, w2 = _weights(e, h, i, torch.bfloat16)
    ids, weights = _routing(t, k, e, seed=3)
    x = torch.randn(t, h, device="cuda").bfloat16()
    act = torch.empty(t * k, i, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(t, h, device="cuda", dtype=torch.bfloat16)

    with pytest.raises(TypeError, match="x must be float16 or bfloat16"):
        ops.moe_decode_gate_up(x.float(), ids, w13)
    with pytest.raises(TypeError, match="w13 must have the dtype of x"):
        ops.moe_decode_gate_up(x, ids, w13.half())
    with pytest.raises(TypeError, match="topk_ids must be int32"):
        ops.moe_decode_gate_up(x, ids.long(), w13)
    with pytest.raises(ValueError, match="x must be a CUDA tensor"):
        _call_gate_up(act, x.cpu(), ids, w13)
    with pytest.raises(ValueError, match=r"w13.shape\[2\]"):
        ops.moe_decode_gate_up(x[:, :32], ids, w13)
    with pytest.raises(ValueError, match="w13.shape\\[1\\] must be even"):
        ops.moe_decode_gate_up(x, ids, w13[:, :-1].contiguous())
    with pytest.raises(ValueError, match="w13 must be contiguous"):
        ops.moe_decode_gate_up(x, ids, w13.transpose(0, 1).contiguous().transpose(0, 1))
    with pytest.raises(ValueError, match="topk_ids.shape\\[0\\]"):
        ops.moe_decode_gate_up(x, ids[:1], w13)
    with pytest.raises(ValueError, match="top_k"):
        ops.moe_decode_gate_up(x, torch.zeros(t, e + 1, dtype=torch.int32, device="cuda"), w13)
    with pytest.raises(ValueError, match="act.shape\\[1\\]"):
        _call_gate_up(act[:, :16], x, ids, w13)
    big = torch.empty(1, 1, ops.MOE_DECODE_MAX_HIDDEN + 8, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="hidden size of at most"):
        ops.moe_decode_gate_up(big[0], ids[:1], big.expand(e, 2, -1).contiguous())

    with pytest.raises(TypeError, match="act must be float16 or bfloat16"):
        ops.moe_decode_down_combine(act.float(), ids, weights, w2)
    with pytest.raises(TypeError, match="out must have the dtype of act"):
        _call_down(out.half(), act, ids, weights, w2)
    with pytest.raises(TypeError, match="topk_weights must be float32"):
        ops.moe_decode_down_combine(act, ids, weights.half(), w2)
    with pytest.raises(ValueError, match="act.shape\\[0\\]"):
        ops.moe_decode_down_combine(act[:1], ids, weights, w2)
    with pytest.raises(ValueError, match="act.shape\\[1\\]"):
        ops.moe_decode_down_combine(act, ids, weights, w2[:, :, :16].contiguous())
    with pytest.raises(ValueError, match="w2 must be contiguous"):
        ops.moe_decode_down_combine(act, ids, weights, w2.transpose(1, 2).contiguous().mT)
    with pytest.raises(ValueError, match="topk_ids.shape\\[0\\]"):
        ops.moe_decode_down_combine(act, ids[:1], weights, w2)
    with pytest.raises(ValueError, match="out.shape\\[1\\]"):
        _call_down(out[:, :32], act, ids, weights, w2)
    with pytest.raises(ValueError, match="out's last dim must be contiguous"):
        _call_down(torch.empty(h, t, device="cuda", dtype=torch.bfloat16).T, act, ids, weights, w2)
