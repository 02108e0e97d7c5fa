"""Batched LoRA kernels (lora_shrink, lora_expand: cpp/cuda/lora_kernels.cu) against float64
torch references on fresh random inputs; ``add_lora``'s kernel path against its torch path;
``add_lora`` captured in a CUDA graph and replayed after the slots changed in place.

Kernel tests fill every slot (the zero slot too) with random weights, so a token whose slot is
-1 (or out of range) can only keep its row if the kernel skips it. in_features 64 and 4096 and
part sizes that are multiples of 8 take the 16-byte vector paths; in_features 100, part sizes
20 + 12 and y rows of odd stride take the scalar paths.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from pydaemon import ops
from pydaemon.layers.lora import punica
from pydaemon.layers.lora.punica import add_lora
from pydaemon.layers.lora.punica_torch import add_lora_torch

DTYPES = [torch.bfloat16, torch.float16]
TOKENS = [1, 3, 16, 64, 300]
RANKS = [8, 16]
PART_SIZES = [(64,), (128, 32), (64, 16, 24)]  # o/down-like, gate/up-like, qkv-like
NUM_SLOTS = 4  # adapter slots; the weight tensors hold one more (the zero slot)
# Expand (rtol, atol): one rounding of y + delta to the dtype (half an ulp: 2^-9 bf16, 2^-12
# fp16), float32 sums otherwise; values of order 1.
TOL = {torch.bfloat16: (8e-3, 1e-4), torch.float16: (1e-3, 1e-4)}
# The torch path rounds xa, the product and the sum to the dtype: a few ulps apart.
TOL_TORCH_PATH = {torch.bfloat16: (3e-2, 3e-2), torch.float16: (5e-3, 5e-3)}


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _randn(*shape, g: torch.Generator, dtype=torch.float32, scale: float = 1.0):
    return (torch.randn(*shape, generator=g) * scale).to(dtype).cuda()


def _token_slots(num_tokens: int, g: torch.Generator, high: int = NUM_SLOTS) -> torch.Tensor:
    """[num_tokens] int64 on the GPU: -1 and slots in [0, high), both present from 2 tokens."""
    slots = torch.randint(-1, high, (num_tokens,), generator=g)
    slots[0] = -1
    if num_tokens > 1:
        slots[-1] = high - 1
    return slots.cuda()


def _lora_weights(in_features, sizes, rank, dtype, g, zero_slot=False):
    """lora_a [S + 1, n * R, in] (rows of norm ~1 against x ~ N(0, 1)), lora_b [S + 1, R,
    sum(sizes)], part_starts; zero_slot: the last slot all zeros, as LoRALinear keeps it."""
    n = len(sizes)
    starts = (0, *itertools.accumulate(sizes))
    lora_a = _randn(NUM_SLOTS + 1, n * rank, in_features, g=g, dtype=dtype,
                    scale=in_features**-0.5)  # fmt: skip
    lora_b = _randn(NUM_SLOTS + 1, rank, starts[-1], g=g, dtype=dtype, scale=0.2)
    if zero_slot:
        lora_a[NUM_SLOTS] = 0
        lora_b[NUM_SLOTS] = 0
    return lora_a, lora_b, starts


def reference_shrink(x, lora_a, token_slots) -> torch.Tensor:
    """float64 [T, n * R]: A[slot] @ x[t], zeros for slots outside [0, S + 1)."""
    has = (token_slots >= 0) & (token_slots < lora_a.shape[0])
    a = lora_a[token_slots.clamp(0, lora_a.shape[0] - 1)].double()  # [T, n * R, in]
    xa = torch.bmm(a, x.double().unsqueeze(2)).squeeze(2)
    return xa * has.double().unsqueeze(1)


def reference_expand(y, xa, lora_b, starts, token_slots) -> torch.Tensor:
    """float64 y + xa_j @ B[slot][:, part j] per part; rows of slots out of range unchanged."""
    has = (token_slots >= 0) & (token_slots < lora_b.shape[0])
    b = lora_b[token_slots.clamp(0, lora_b.shape[0] - 1)].double()  # [T, R, out]
    rank = lora_b.shape[1]
    out = y.double().clone()
    for j in range(len(starts) - 1):
        xa_j = xa[:, j * rank : (j + 1) * rank].double().unsqueeze(1)  # [T, 1, R]
        delta = torch.bmm(xa_j, b[:, :, starts[j] : starts[j + 1]]).squeeze(1)
        out[:, starts[j] : starts[j + 1]] += delta * has.double().unsqueeze(1)
    return out


def reference_add_lora(y, x, token_slots, lora_a, lora_b, starts) -> torch.Tensor:
    return reference_expand(y, reference_shrink(x, lora_a, token_slots), lora_b, starts,
                            token_slots)  # fmt: skip


def assert_expand_close(got, want, y0, token_slots, dtype, what):
    assert not torch.isnan(got).any(), f"{what}: NaN"
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(got.double(), want, rtol=rtol, atol=atol,
                               msg=lambda m: f"{what}: {m}")  # fmt: skip
    skipped = (token_slots < 0) | (token_slots >= NUM_SLOTS + 1)
    assert torch.equal(got[skipped], y0[skipped]), f"{what}: a row without adapter changed"


def _no_torch_path(*args, **kwargs):
    raise AssertionError("add_lora took the torch path on CUDA")


# ---- lora_shrink ------------------------------------------------------------------------------


@pytest.mark.parametrize("num_tokens", TOKENS)
@pytest.mark.parametrize("in_features", [64, 4096, 100])
@pytest.mark.parametrize("num_parts", [1, 2, 3])
@pytest.mark.parametrize("rank", RANKS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_shrink_matches_float64(dtype, rank, num_parts, in_features, num_tokens):
    g = _gen(num_tokens * 1000 + in_features + 10 * num_parts + rank)
    x = _randn(num_tokens, in_features, g=g, dtype=dtype)
    lora_a = _randn(NUM_SLOTS + 1, num_parts * rank, in_features, g=g, dtype=dtype,
                    scale=in_features**-0.5)  # fmt: skip
    token_slots = _token_slots(num_tokens, g, high=NUM_SLOTS + 1)  # the last slot too
    xa = ops.lora_shrink(x, lora_a, token_slots)
    assert xa.dtype == torch.float32 and xa.shape == (num_tokens, num_parts * rank)
    want = reference_shrink(x, lora_a, token_slots)
    torch.testing.assert_close(xa.double(), want, rtol=1e-4, atol=1e-4)
    assert torch.all(xa[token_slots < 0] == 0), "a token without adapter got a nonzero xa"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_shrink_strided_x_rows_and_out_of_range_slots(dtype):
    g = _gen(7)
    num_tokens, in_features, rank = 37, 4096, 16
    x = _randn(num_tokens, in_features + 8, g=g, dtype=dtype)[:, :in_features]  # aligned rows
    lora_a = _randn(NUM_SLOTS + 1, 2 * rank, in_features, g=g, dtype=dtype, scale=1 / 64)
    token_slots = _token_slots(num_tokens, g)
    token_slots[1] = NUM_SLOTS + 1  # past the last slot: no adapter, nothing read
    token_slots[2] = -5
    xa = ops.lora_shrink(x, lora_a, token_slots)
    torch.testing.assert_close(xa.double(), reference_shrink(x, lora_a, token_slots),
                               rtol=1e-4, atol=1e-4)  # fmt: skip
    assert torch.all(xa[1:3] == 0)
    x_odd = _randn(num_tokens, in_features + 1, g=g, dtype=dtype)[:, :in_features]  # scalar
    xa = ops.lora_shrink(x_odd, lora_a, token_slots)
    torch.testing.assert_close(xa.double(), reference_shrink(x_odd, lora_a, token_slots),
                               rtol=1e-4, atol=1e-4)  # fmt: skip


# ---- lora_expand ------------------------------------------------------------------------------


@pytest.mark.parametrize("num_tokens", TOKENS)
@pytest.mark.parametrize("sizes", PART_SIZES + [(20, 12)], ids=str)
@pytest.mark.parametrize("rank", RANKS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_expand_matches_float64_and_keeps_y(dtype, rank, sizes, num_tokens):
    g = _gen(num_tokens * 100 + sum(sizes) + rank)
    _, lora_b, starts = _lora_weights(8, sizes, rank, dtype, g)
    xa = _randn(num_tokens, len(sizes) * rank, g=g)
    y = _randn(num_tokens, starts[-1], g=g, dtype=dtype)
    y0 = y.clone()
    token_slots = _token_slots(num_tokens, g, high=NUM_SLOTS + 1)
    ops.lora_expand(y, xa, lora_b, starts, token_slots)
    want = reference_expand(y0, xa, lora_b, starts, token_slots)
    assert_expand_close(y, want, y0, token_slots, dtype, f"y += (sizes {sizes})")


@pytest.mark.parametrize("pad", [0, 8, 1])  # contiguous, strided aligned, strided unaligned
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_expand_llama_qkv_layout_with_strided_rows(dtype, pad):
    """Llama-3-8B's qkv columns (4096 + 1024 + 1024), many blocks per token."""
    g = _gen(pad)
    num_tokens, rank, sizes = 19, 16, (4096, 1024, 1024)
    _, lora_b, starts = _lora_weights(8, sizes, rank, dtype, g)
    xa = _randn(num_tokens, 3 * rank, g=g)
    y = _randn(num_tokens, starts[-1] + pad, g=g, dtype=dtype)[:, : starts[-1]]
    y0 = y.clone()
    token_slots = _token_slots(num_tokens, g)
    token_slots[2] = NUM_SLOTS + 7  # out of range: the row stays
    ops.lora_expand(y, xa, lora_b, starts, token_slots)
    want = reference_expand(y0, xa, lora_b, starts, token_slots)
    assert_expand_close(y, want, y0, token_slots, dtype, f"y (pad {pad})")


# ---- add_lora: the kernel path --------------------------------------------------------------


@pytest.mark.parametrize("num_tokens", TOKENS)
@pytest.mark.parametrize("sizes", PART_SIZES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_add_lora_kernel_path_equals_torch_path(dtype, sizes, num_tokens, monkeypatch):
    g = _gen(num_tokens + sum(sizes))
    in_features, rank = 512, 16
    lora_a, lora_b, starts = _lora_weights(in_features, sizes, rank, dtype, g, zero_slot=True)
    x = _randn(num_tokens, in_features, g=g, dtype=dtype)
    y = _randn(num_tokens, starts[-1], g=g, dtype=dtype)
    y0 = y.clone()
    token_slots = _token_slots(num_tokens, g)

    with monkeypatch.context() as m:
        m.setattr(punica, "add_lora_torch", _no_torch_path)
        m.setattr(punica, "LORA_KERNEL_MAX_TOKENS", max(num_tokens, punica.LORA_KERNEL_MAX_TOKENS))
        add_lora(y, x, token_slots, lora_a, lora_b, starts)
    want = reference_add_lora(y0, x, token_slots, lora_a, lora_b, starts)
    assert_expand_close(y, want, y0, token_slots, dtype, "add_lora (kernels)")
    y_torch = y0.clone()
    add_lora_torch(y_torch, x, token_slots, lora_a, lora_b, starts)
    rtol, atol = TOL_TORCH_PATH[dtype]
    torch.testing.assert_close(y, y_torch, rtol=rtol, atol=atol)


def test_add_lora_takes_the_torch_path_above_the_token_bound_and_for_float32(monkeypatch):
    def no_kernels(*args, **kwargs):
        raise AssertionError("add_lora ran the kernels")

    monkeypatch.setattr(ops, "lora_shrink", no_kernels)
    g = _gen(3)
    bound = punica.LORA_KERNEL_MAX_TOKENS
    for num_tokens, dtype in [(bound + 1, torch.bfloat16), (4, torch.float32)]:
        lora_a, lora_b, starts = _lora_weights(64, (32, 16), 8, dtype, g, zero_slot=True)
        x = _randn(num_tokens, 64, g=g, dtype=dtype)
        y = _randn(num_tokens, starts[-1], g=g, dtype=dtype)
        token_slots = _token_slots(num_tokens, g)
        want = reference_add_lora(y, x, token_slots, lora_a, lora_b, starts)
        add_lora(y, x, token_slots, lora_a, lora_b, starts)
        torch.testing.assert_close(y.double(), want, rtol=3e-2, atol=3e-2)


# ---- CUDA graphs --------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_add_lora_in_a_cuda_graph_reads_slots_and_weights_at_replay(dtype, monkeypatch):
    """Captured once; then token_slots, a slot's A and B and x change in place (as the LoRA
    manager and the runner change them between steps), and the replay follows them."""
    g = _gen(11)
    num_tokens, in_features, rank, sizes = 8, 256, 16, (64, 16, 24)
    lora_a, lora_b, starts = _lora_weights(in_features, sizes, rank, dtype, g, zero_slot=True)
    x = _randn(num_tokens, in_features, g=g, dtype=dtype)
    y_base = _randn(num_tokens, starts[-1], g=g, dtype=dtype)  # the base layer's output
    y = torch.empty_like(y_base)
    token_slots = _token_slots(num_tokens, g)

    def step() -> None:
        y.copy_(y_base)
        add_lora(y, x, token_slots, lora_a, lora_b, starts)

    step()  # warm-up outside the graph (module loading, the allocator)
    torch.cuda.synchronize()
    monkeypatch.setattr(punica, "add_lora_torch", _no_torch_path)  # the kernels are captured
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    token_slots.copy_(torch.tensor([2, -1, 0, 2, 3, -1, 1, 2]))
    lora_a[2].copy_(_randn(*lora_a.shape[1:], g=g, dtype=dtype, scale=in_features**-0.5))
    lora_b[2].copy_(_randn(*lora_b.shape[1:], g=g, dtype=dtype, scale=0.2))
    x.copy_(_randn(num_tokens, in_features, g=g, dtype=dtype))
    graph.replay()
    torch.cuda.synchronize()
    want = reference_add_lora(y_base, x, token_slots, lora_a, lora_b, starts)
    assert_expand_close(y, want, y_base, token_slots, dtype, "replay")


# ---- argument checks -------------------------------------------------------------------------


def test_shrink_rejects_bad_arguments_with_clear_messages():
    g = _gen(5)
    bf16 = torch.bfloat16
    x = _randn(4, 64, g=g, dtype=bf16)
    lora_a = _randn(NUM_SLOTS + 1, 16, 64, g=g, dtype=bf16)
    slots = _token_slots(4, g)
    with pytest.raises(TypeError, match="x must be float16 or bfloat16, got float32"):
        ops.lora_shrink(x.float(), lora_a, slots)
    with pytest.raises(TypeError, match="lora_a must have the dtype of x"):
        ops.lora_shrink(x, lora_a.half(), slots)
    with pytest.raises(ValueError, match=r"lora_a.shape\[2\] must be 64"):
        ops.lora_shrink(x, lora_a[:, :, :32].contiguous(), slots)
    with pytest.raises(ValueError, match="lora_a must be contiguous"):
        ops.lora_shrink(x, lora_a.transpose(1, 2).contiguous().transpose(1, 2), slots)
    with pytest.raises(ValueError, match="x's last dim must be contiguous"):
        ops.lora_shrink(x.t().contiguous().t(), lora_a, slots)
    with pytest.raises(TypeError, match="token_slots must be int64"):
        ops.lora_shrink(x, lora_a, slots.int())
    with pytest.raises(ValueError, match=r"token_slots.shape\[0\] must be 4"):
        ops.lora_shrink(x, lora_a, slots[:3])
    with pytest.raises(ValueError, match="lora_a must be a CUDA tensor"):
        ops.lora_shrink(x, lora_a.cpu(), slots)


def test_expand_rejects_bad_arguments_with_clear_messages():
    g = _gen(6)
    bf16 = torch.bfloat16
    starts = (0, 32, 48)
    y = _randn(4, 48, g=g, dtype=bf16)
    xa = _randn(4, 2 * 8, g=g)
    lora_b = _randn(NUM_SLOTS + 1, 8, 48, g=g, dtype=bf16)
    slots = _token_slots(4, g)
    with pytest.raises(TypeError, match="y must be float16 or bfloat16"):
        ops.lora_expand(y.float(), xa, lora_b, starts, slots)
    with pytest.raises(TypeError, match="lora_b must have the dtype of y"):
        ops.lora_expand(y, xa, lora_b.half(), starts, slots)
    with pytest.raises(TypeError, match="xa must be float32, got bfloat16"):
        ops.lora_expand(y, xa.to(bf16), lora_b, starts, slots)
    with pytest.raises(ValueError, match=r"xa.shape\[1\] must be 16"):
        ops.lora_expand(y, xa[:, :8].contiguous(), lora_b, starts, slots)
    with pytest.raises(ValueError, match=r"lora_b.shape\[2\] must be 48"):
        ops.lora_expand(y, xa, lora_b[:, :, :40].contiguous(), starts, slots)
    with pytest.raises(ValueError, match="lora_b must be contiguous"):
        ops.lora_expand(y, xa, lora_b.transpose(1, 2).contiguous().transpose(1, 2), starts,
                        slots)  # fmt: skip
    with pytest.raises(ValueError, match="y's last dim must be contiguous"):
        ops.lora_expand(y.t().contiguous().t(), xa, lora_b, starts, slots)
    with pytest.raises(ValueError, match="xa must be contiguous"):
        ops.lora_expand(y, xa.t().contiguous().t(), lora_b, starts, slots)
    with pytest.raises(ValueError, match="part_starts must rise strictly from 0 to"):
        ops.lora_expand(y, xa, lora_b, (0, 32, 40), slots)
    with pytest.raises(ValueError, match="part_starts must hold num_parts"):
        ops.lora_expand(y, _randn(4, 5 * 8, g=g), lora_b, (0, 8, 16, 24, 32, 48), slots)
