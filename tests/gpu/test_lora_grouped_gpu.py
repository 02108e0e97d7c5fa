"""The segmented LoRA path (pydaemon/layers/lora/punica_grouped.py: torch._grouped_mm's CUTLASS
kernels, bf16, Hopper / datacenter Blackwell) against the float64 reference and the dense
torch path, at the Llama-3-8B shapes with 32 slots of rank 16, above the BGMV kernels' bound;
captured in a CUDA graph and replayed after the slots, the weights and x changed in place
(``add_lora`` alone, and a ``LoRALinear`` warmed up eagerly first: its grouping must be made
again inside the graph); the grouping on the device (pagedd's moe_align) against the sort.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pydaemon.layers.lora import punica, punica_grouped, punica_triton
from pydaemon.layers.lora.lora_linear import LoRALinear, LoRASlots
from pydaemon.layers.lora.punica import add_lora
from pydaemon.layers.lora.punica_grouped import slot_grouping
from pydaemon.layers.lora.punica_torch import add_lora_torch
from pydaemon.layers.moe.align import moe_align_native

from .test_lora_kernels_gpu import _gen, _randn, reference_add_lora

BF16 = torch.bfloat16
SLOTS = 32  # adapter slots (W1's --max-loras 32); the weights hold one more, all zeros
RANK = 16
TOKENS = [65, 200, 512]  # above LORA_KERNEL_MAX_TOKENS (64): W1's decode steps
# (in_features, part sizes): qkv, gate/up (Llama-3-8B's halved), o
SHAPES = [(4096, (4096, 1024, 1024)), (4096, (7168, 7168)), (4096, (4096,))]
# xa and the delta rounded to bf16, then y + delta rounded: a few bf16 ulps; values of order 1.
TOL = (3e-2, 3e-2)


@pytest.fixture(autouse=True)
def _grouped_device(monkeypatch):
    x = torch.empty(1, 8, dtype=BF16, device="cuda")
    if not punica_grouped.use_grouped_mm(x):
        pytest.skip("torch._grouped_mm's CUTLASS kernels need a 9.x or 10.x GPU")
    # This path, not the Triton one that add_lora prefers (both switches' defaults aside).
    monkeypatch.setattr(punica_triton, "LORA_TRITON", False)
    monkeypatch.setattr(punica_grouped, "LORA_GROUPED", True)


def _no_dense_path(*args, **kwargs):
    raise AssertionError("add_lora took the dense torch path")


def _weights(in_features, sizes, g):
    starts = (0, *[sum(sizes[: j + 1]) for j in range(len(sizes))])
    lora_a = _randn(SLOTS + 1, len(sizes) * RANK, in_features, g=g, dtype=BF16,
                    scale=in_features**-0.5)  # fmt: skip
    lora_b = _randn(SLOTS + 1, RANK, starts[-1], g=g, dtype=BF16, scale=0.2)
    lora_a[SLOTS] = 0
    lora_b[SLOTS] = 0
    return lora_a, lora_b, starts


def _slots(num_tokens, g, high=12):
    """-1 and slots in [0, high): slots at and above ``high`` get no token."""
    slots = torch.randint(-1, high, (num_tokens,), generator=g)
    slots[0] = -1
    return slots.cuda()


@pytest.mark.parametrize("num_tokens", TOKENS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: str(s[1]))
def test_grouped_path_matches_reference_and_dense_path(shape, num_tokens, monkeypatch):
    in_features, sizes = shape
    g = _gen(num_tokens + sum(sizes))
    lora_a, lora_b, starts = _weights(in_features, sizes, g)
    x = _randn(num_tokens, in_features, g=g, dtype=BF16)
    y0 = _randn(num_tokens, starts[-1], g=g, dtype=BF16)
    token_slots = _slots(num_tokens, g)
    y = y0.clone()
    with monkeypatch.context() as m:
        m.setattr(punica, "add_lora_torch", _no_dense_path)
        add_lora(y, x, token_slots, lora_a, lora_b, starts)
    torch.cuda.synchronize()
    assert not torch.isnan(y).any()
    want = reference_add_lora(y0, x, token_slots, lora_a, lora_b, starts)
    torch.testing.assert_close(y.double(), want, rtol=TOL[0], atol=TOL[1])
    skipped = token_slots < 0
    assert torch.equal(y[skipped], y0[skipped]), "a row without an adapter changed"
    dense = y0.clone()
    add_lora_torch(dense, x, token_slots, lora_a, lora_b, starts)
    torch.testing.assert_close(y, dense, rtol=TOL[0], atol=TOL[1])


def test_one_slot_and_no_adapter_steps():
    g = _gen(5)
    lora_a, lora_b, starts = _weights(4096, (4096, 1024, 1024), g)
    x = _randn(200, 4096, g=g, dtype=BF16)
    y0 = _randn(200, starts[-1], g=g, dtype=BF16)
    for token_slots in (torch.full((200,), 7), torch.full((200,), -1)):
        token_slots = token_slots.cuda()
        y = y0.clone()
        add_lora(y, x, token_slots, lora_a, lora_b, starts)
        want = reference_add_lora(y0, x, token_slots, lora_a, lora_b, starts)
        torch.testing.assert_close(y.double(), want, rtol=TOL[0], atol=TOL[1])


@pytest.mark.parametrize("num_tokens", TOKENS)
def test_grouped_add_lora_in_a_cuda_graph(num_tokens, monkeypatch):
    g = _gen(100 + num_tokens)
    lora_a, lora_b, starts = _weights(4096, (4096, 1024, 1024), g)
    x = _randn(num_tokens, 4096, g=g, dtype=BF16)
    y_base = _randn(num_tokens, starts[-1], g=g, dtype=BF16)
    y = torch.empty_like(y_base)
    token_slots = _slots(num_tokens, g)

    def step():
        y.copy_(y_base)
        add_lora(y, x, token_slots, lora_a, lora_b, starts)

    monkeypatch.setattr(punica, "add_lora_torch", _no_dense_path)
    step()  # warm-up outside the graph
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    token_slots.copy_(_slots(num_tokens, g, high=SLOTS))
    lora_a[3].copy_(_randn(*lora_a.shape[1:], g=g, dtype=BF16, scale=4096**-0.5))
    lora_b[3].copy_(_randn(*lora_b.shape[1:], g=g, dtype=BF16, scale=0.2))
    x.copy_(_randn(num_tokens, 4096, g=g, dtype=BF16))
    graph.replay()
    torch.cuda.synchronize()
    want = reference_add_lora(y_base, x, token_slots, lora_a, lora_b, starts)
    torch.testing.assert_close(y.double(), want, rtol=TOL[0], atol=TOL[1])


def test_lora_linear_makes_its_grouping_inside_the_graph(monkeypatch):
    """An eager call, then a capture with the same slots: the capture must not reuse the
    eager grouping (its tensors are not the graph's; the replay would read stale ones)."""
    g = _gen(9)
    num_tokens, in_features, sizes = 200, 1024, (1024, 256, 256)
    slots = LoRASlots(SLOTS, RANK, max_num_tokens=512, device=torch.device("cuda"))
    base = nn.Linear(in_features, sum(sizes), bias=False, device="cuda", dtype=BF16)
    layer = LoRALinear(base, ("q", "k", "v"), sizes, slots, BF16)
    lora_a, lora_b, starts = _weights(in_features, sizes, g)
    layer.lora_a.copy_(lora_a)
    layer.lora_b.copy_(lora_b)
    x = _randn(num_tokens, in_features, g=g, dtype=BF16)
    slots.token_slots[:num_tokens].copy_(_slots(num_tokens, g))
    monkeypatch.setattr(punica, "add_lora_torch", _no_dense_path)
    with torch.no_grad():
        layer(x)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = layer(x)
        new_slots = _slots(num_tokens, g, high=SLOTS)
        slots.token_slots[:num_tokens].copy_(new_slots)
        layer(x)  # an eager step in between: its own grouping, the graph's stays
        graph.replay()
        torch.cuda.synchronize()
        want = reference_add_lora(base(x), x, new_slots, layer.lora_a, layer.lora_b, starts)
    torch.testing.assert_close(out.double(), want, rtol=TOL[0], atol=TOL[1])


def test_slot_grouping_on_the_device_equals_the_sort():
    g = _gen(3)
    token_slots = _slots(512, g, high=SLOTS)
    sorted_ids, offsets = slot_grouping(token_slots, SLOTS + 1)
    keys = torch.remainder(token_slots, SLOTS + 1).to(torch.int32).view(-1, 1)
    _, _, want_offsets = moe_align_native(keys, SLOTS + 1)
    assert torch.equal(offsets, want_offsets)
    assert torch.equal(sorted_ids.sort().values.long(), torch.arange(512, device="cuda"))
    got_keys = keys.view(-1)[sorted_ids.long()]
    assert torch.equal(got_keys, got_keys.sort().values), "rows not grouped by slot"
