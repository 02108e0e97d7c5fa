"""The segmented LoRA path (pydaemon/layers/lora/punica_grouped.py) on the CPU.

torch._grouped_mm itself (where this torch has a CPU version) in float32 against a float64
per-token loop; a strict stand-in for its CUDA (CUTLASS) version in bfloat16 that enforces
that version's rules (bf16, int32 offsets that cover every row, 16-byte aligned pointers and
row strides, fewer than 1024 groups) and leaves NaN in rows it does not compute, against the
loop and the dense torch path; the grouping; ``add_lora``'s choice of path; a model's LoRA
layers sharing one grouping a forward.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from lora_utils import reference_add_lora_loop as reference
from torch import nn

from pydaemon.layers.lora import lora_linear, punica, punica_grouped
from pydaemon.layers.lora.lora_linear import LoRASlots, wrap_lora_layers
from pydaemon.layers.lora.punica import add_lora
from pydaemon.layers.lora.punica_grouped import add_lora_grouped, slot_grouping
from pydaemon.layers.lora.punica_torch import add_lora_torch

NUM_SLOTS = 6  # adapter slots; the weights hold one more (the zero slot, for -1)
RANK = 16
IN = 64
# token slots: 4 adapters and no adapter, unsorted, slots 4 and 5 without a token; one token
# (with and without an adapter); every token in one slot; no token with an adapter.
SLOT_CASES = {
    "mixed": [3, -1, 0, 3, 1, -1, 0, 0, 2, 3, 1, -1, 3, 2, 0, 1, 1, -1, 3, 0, 2, 2, 1],
    "one": [2],
    "one_none": [-1],
    "one_slot": [5] * 19,
    "none": [-1] * 9,
}
PART_SIZES = [(64, 16, 16), (32, 32), (64,)]  # qkv-like (unequal), gate/up, o/down


def _weights(sizes, dtype, seed, rank=RANK):
    """lora_a, lora_b, starts as LoRALinear keeps them: the zero slot last, slot 0 an adapter
    of rank 8 zero-padded to ``rank`` (rows of A and B past 8 are zeros)."""
    g = torch.Generator().manual_seed(seed)
    n, starts = len(sizes), (0, *itertools.accumulate(sizes))
    lora_a = torch.randn(NUM_SLOTS + 1, n * rank, IN, generator=g) * IN**-0.5
    lora_b = torch.randn(NUM_SLOTS + 1, rank, starts[-1], generator=g) * 0.2
    lora_a[NUM_SLOTS] = 0
    lora_b[NUM_SLOTS] = 0
    for j in range(n):
        lora_a[0, j * rank + 8 : (j + 1) * rank] = 0
    lora_b[0, 8:] = 0
    return lora_a.to(dtype), lora_b.to(dtype), starts


def _inputs(num_tokens, out, dtype, seed):
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(num_tokens, IN, generator=g).to(dtype)
    y = torch.randn(num_tokens, out, generator=g).to(dtype)
    return x, y


def _check_operand(name, m):
    """torch's check_valid_strides_and_return_transposed, with the CUDA pointer check."""
    assert m.data_ptr() % 16 == 0, f"{name}: data_ptr not 16-byte aligned"
    (s0, s1), (n0, n1) = m.stride()[-2:], m.shape[-2:]
    if s0 == 1 and s1 >= max(1, n0):
        assert s1 % 8 == 0, f"{name}: column stride {s1} not a multiple of 16 bytes"
    elif s1 == 1 and s0 >= max(1, n1):
        assert s0 % 8 == 0, f"{name}: row stride {s0} not a multiple of 16 bytes"
    else:
        raise AssertionError(f"{name}: invalid strides {m.stride()} for sizes {m.shape}")


def strict_grouped_mm(a, b, offs=None, bias=None, out_dtype=None):
    """torch._grouped_mm (2d x 3d) as its CUTLASS version takes it; float32 sums, rounded once;
    rows past the last offset stay NaN (CUTLASS leaves them unwritten)."""
    assert a.dtype == b.dtype == torch.bfloat16, "the CUTLASS kernels are bf16 only"
    assert bias is None and out_dtype in (None, torch.bfloat16)
    assert a.dim() == 2 and b.dim() == 3 and a.shape[1] == b.shape[1]
    assert offs is not None and offs.dtype == torch.int32 and offs.dim() == 1
    assert offs.shape[0] == b.shape[0] < 1024
    _check_operand("mat_a", a)
    _check_operand("mat_b", b)
    ends = offs.tolist()
    assert ends == sorted(ends) and ends[-1] == a.shape[0], f"offsets {ends} miss rows"
    out = torch.full((a.shape[0], b.shape[2]), float("nan"), dtype=torch.bfloat16)
    start = 0
    for g, end in enumerate(ends):
        out[start:end] = (a[start:end].float() @ b[g].float()).to(torch.bfloat16)
        start = end
    return out


def _cpu_grouped_mm_runs() -> bool:
    try:
        a, b = torch.ones(2, 8), torch.ones(2, 8, 8)
        torch._grouped_mm(a, b, offs=torch.tensor([1, 2], dtype=torch.int32))
        return True
    except (AttributeError, RuntimeError, NotImplementedError):
        return False


# ---- the grouping -------------------------------------------------------------------------


def test_slot_grouping_orders_tokens_by_slot_the_zero_slot_last():
    token_slots = torch.tensor(SLOT_CASES["mixed"])
    sorted_ids, offsets = slot_grouping(token_slots, NUM_SLOTS + 1)
    assert sorted_ids.dtype == offsets.dtype == torch.int32
    counts = [SLOT_CASES["mixed"].count(s) for s in range(NUM_SLOTS)]
    counts.append(SLOT_CASES["mixed"].count(-1))
    assert offsets.tolist() == list(itertools.accumulate(counts))
    assert sorted(sorted_ids.tolist()) == list(range(len(token_slots)))  # a permutation
    keys = token_slots[sorted_ids.long()].tolist()
    assert keys == sorted(keys, key=lambda s: NUM_SLOTS if s < 0 else s)


# ---- the path against a float64 loop and the dense torch path --------------------------------


@pytest.mark.skipif(not _cpu_grouped_mm_runs(), reason="no CPU torch._grouped_mm in this torch")
@pytest.mark.parametrize("case", SLOT_CASES)
@pytest.mark.parametrize("sizes", PART_SIZES, ids=str)
def test_torch_grouped_mm_float32_matches_float64_loop(sizes, case):
    lora_a, lora_b, starts = _weights(sizes, torch.float32, seed=len(case) + sum(sizes))
    token_slots = torch.tensor(SLOT_CASES[case])
    x, y = _inputs(len(token_slots), starts[-1], torch.float32, seed=sum(sizes))
    want = reference(y, x, token_slots, lora_a, lora_b, starts)
    add_lora_grouped(y, x, token_slots, lora_a, lora_b, starts)
    torch.testing.assert_close(y.double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", SLOT_CASES)
@pytest.mark.parametrize("sizes", PART_SIZES, ids=str)
def test_bf16_under_cuda_rules_matches_loop_and_dense_path(sizes, case, monkeypatch):
    monkeypatch.setattr(torch, "_grouped_mm", strict_grouped_mm, raising=False)
    bf16 = torch.bfloat16
    lora_a, lora_b, starts = _weights(sizes, bf16, seed=len(case) * 7 + sum(sizes))
    token_slots = torch.tensor(SLOT_CASES[case])
    x, y0 = _inputs(len(token_slots), starts[-1], bf16, seed=3 * sum(sizes))
    y = y0.clone()
    add_lora_grouped(y, x, token_slots, lora_a, lora_b, starts)
    assert not torch.isnan(y).any()
    # xa and the delta rounded to bf16, then y + delta: a few bf16 ulps of values of order 1
    want = reference(y0, x, token_slots, lora_a, lora_b, starts)
    torch.testing.assert_close(y.double(), want, rtol=2e-2, atol=2e-2)
    untouched = token_slots < 0
    assert torch.equal(y[untouched], y0[untouched]), "a row without an adapter changed"
    dense = y0.clone()
    add_lora_torch(dense, x, token_slots, lora_a, lora_b, starts)
    torch.testing.assert_close(y, dense, rtol=3e-2, atol=3e-2)


def test_strict_stand_in_refuses_what_cuda_refuses():
    a = torch.zeros(4, 16, dtype=torch.bfloat16)
    b = torch.zeros(2, 16, 8, dtype=torch.bfloat16)
    offs = torch.tensor([1, 4], dtype=torch.int32)
    strict_grouped_mm(a, b, offs)
    with pytest.raises(AssertionError, match="miss rows"):
        strict_grouped_mm(a, b, torch.tensor([1, 3], dtype=torch.int32))
    with pytest.raises(AssertionError, match="16-byte"):
        strict_grouped_mm(torch.zeros(4, 20, dtype=torch.bfloat16)[:, 2:18], b, offs)
    with pytest.raises(AssertionError, match="bf16 only"):
        strict_grouped_mm(a.float(), b.float(), offs)


# ---- add_lora's choice ------------------------------------------------------------------------


def _fail(what):
    def fail(*args, **kwargs):
        raise AssertionError(f"add_lora took {what}")

    return fail


@pytest.fixture
def hopper(monkeypatch):
    """As on an H200: bf16 tensors take torch._grouped_mm (the strict stand-in) here."""
    monkeypatch.setattr(torch, "_grouped_mm", strict_grouped_mm, raising=False)
    monkeypatch.setattr(punica_grouped, "use_grouped_mm", lambda x: x.dtype == torch.bfloat16)
    monkeypatch.setattr(punica_grouped, "LORA_GROUPED", True)
    monkeypatch.setattr(punica_grouped, "LORA_GROUPED_MIN_TOKENS", 0)
    return monkeypatch


def _add_lora_case(num_tokens, dtype, sizes=(64, 16, 16)):
    lora_a, lora_b, starts = _weights(sizes, dtype, seed=num_tokens)
    g = torch.Generator().manual_seed(num_tokens)
    token_slots = torch.randint(-1, 4, (num_tokens,), generator=g)
    x, y = _inputs(num_tokens, starts[-1], dtype, seed=num_tokens)
    return y, x, token_slots, lora_a, lora_b, starts


def test_add_lora_takes_the_grouped_path_above_the_kernel_bound(hopper):
    hopper.setattr(punica, "add_lora_torch", _fail("the dense torch path"))
    num_tokens = punica.LORA_KERNEL_MAX_TOKENS + 1
    y, x, token_slots, lora_a, lora_b, starts = _add_lora_case(num_tokens, torch.bfloat16)
    want = reference(y, x, token_slots, lora_a, lora_b, starts)
    add_lora(y, x, token_slots, lora_a, lora_b, starts)
    torch.testing.assert_close(y.double(), want, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize(
    "what", ["switch off", "min tokens", "kernel bound", "float32", "unaligned parts"]
)
def test_add_lora_keeps_the_torch_path(hopper, what):
    hopper.setattr(punica, "add_lora_grouped", _fail("the grouped path"))
    num_tokens, dtype, sizes = punica.LORA_KERNEL_MAX_TOKENS + 1, torch.bfloat16, (64, 16, 16)
    if what == "switch off":
        hopper.setattr(punica_grouped, "LORA_GROUPED", False)
    elif what == "min tokens":
        hopper.setattr(punica_grouped, "LORA_GROUPED_MIN_TOKENS", num_tokens + 1)
    elif what == "kernel bound":
        num_tokens -= 1  # the BGMV kernels' steps (here on the CPU: the torch path)
    elif what == "float32":
        dtype = torch.float32
    else:
        sizes = (20, 12)  # part 1 starts at column 20: not 16-byte aligned
    y, x, token_slots, lora_a, lora_b, starts = _add_lora_case(num_tokens, dtype, sizes)
    want = reference(y, x, token_slots, lora_a, lora_b, starts)
    add_lora(y, x, token_slots, lora_a, lora_b, starts)
    torch.testing.assert_close(y.double(), want, rtol=3e-2, atol=3e-2)


# ---- one grouping a model forward -----------------------------------------------------------


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.self_attn, self.mlp = nn.Module(), nn.Module()
        self.self_attn.o_proj = nn.Linear(IN, IN, bias=False, dtype=torch.bfloat16)
        self.mlp.down_proj = nn.Linear(IN, IN, bias=False, dtype=torch.bfloat16)

    def forward(self, x):
        return self.mlp.down_proj(self.self_attn.o_proj(x))


class _Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.model = nn.Module()
        self.model.layers = nn.ModuleList([_Block(), _Block()])

    def forward(self, x):
        for layer in self.model.layers:
            x = layer(x)
        return x


def test_a_forward_makes_one_grouping_for_all_its_layers(hopper):
    calls = []

    def counted(token_slots, num_groups):
        calls.append(token_slots.shape[0])
        return slot_grouping(token_slots, num_groups)

    hopper.setattr(lora_linear, "slot_grouping", counted)
    torch.manual_seed(0)
    model = _Model()
    slots = LoRASlots(max_loras=NUM_SLOTS, max_lora_rank=RANK, max_num_tokens=128,
                      device=torch.device("cpu"))  # fmt: skip
    wrapped = wrap_lora_layers(model, slots, torch.bfloat16)
    layers = {id(w): w for w, _ in wrapped.values()}.values()
    assert len(layers) == 4
    for layer in layers:
        layer.lora_a[:NUM_SLOTS] = torch.randn(NUM_SLOTS, RANK, IN) * IN**-0.5
        layer.lora_b[:NUM_SLOTS] = torch.randn(NUM_SLOTS, RANK, IN) * 0.2
    num_tokens = punica.LORA_KERNEL_MAX_TOKENS + 6
    slots.token_slots[:num_tokens] = torch.randint(-1, NUM_SLOTS, (num_tokens,))
    x = torch.randn(num_tokens, IN).to(torch.bfloat16)

    y = model(x)
    assert calls == [num_tokens]  # the first layer made it, the three others reused it
    model(x)
    assert calls == [num_tokens] * 2  # each forward makes its own (a graph captures its own)
    hopper.setattr(punica_grouped, "LORA_GROUPED", False)
    y_dense = model(x)
    assert len(calls) == 2
    torch.testing.assert_close(y, y_dense, rtol=5e-2, atol=5e-2)

    hopper.setattr(punica_grouped, "LORA_GROUPED", True)
    layer = next(iter(layers))
    layer(x)  # a layer alone (no model forward): the last forward (dense) made no grouping
    layer(x)
    assert len(calls) == 3  # the second call reused the first's: the slots have not changed
    slots.token_slots[:num_tokens] = torch.randint(-1, NUM_SLOTS, (num_tokens,))
    layer(x)
    assert len(calls) == 4  # the slots changed in place (their version): made again
    layer(x[:-1])
    assert calls[-1] == num_tokens - 1  # another token count: made again
