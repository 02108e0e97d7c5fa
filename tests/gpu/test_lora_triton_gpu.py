"""The Triton SGMV path of LoRA (pydaemon/layers/lora/punica_triton.py, switched on here)
against the float64 reference and the dense torch path, at the Llama-3-8B shapes with 32
slots of rank 16, above the BGMV kernels' bound (bf16, and fp16 for one shape); captured in
a CUDA graph after an eager warm-up and replayed after the slots, the weights and x changed in
place (``add_lora`` alone, and a ``LoRALinear``); a capture that meets a layer never launched
eagerly takes another path (no Triton compilation inside a capture).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from torch import nn

from pydaemon.layers.lora import punica, punica_triton
from pydaemon.layers.lora.lora_linear import LoRALinear, LoRASlots
from pydaemon.layers.lora.punica import add_lora
from pydaemon.layers.lora.punica_grouped import add_lora_grouped
from pydaemon.layers.lora.punica_torch import add_lora_torch

from .test_lora_kernels_gpu import _gen, _randn, reference_add_lora

BF16 = torch.bfloat16
SLOTS = 32  # adapter slots (W1's --max-loras 32); the weights hold one more, all zeros
RANK = 16
TOKENS = [65, 200, 512]  # above LORA_KERNEL_MAX_TOKENS (64): W1's decode steps
# (in_features, part sizes): qkv, gate/up (Llama-3-8B's), o, down (split-K of 8)
SHAPES = [(4096, (4096, 1024, 1024)), (4096, (14336, 14336)), (4096, (4096,)), (14336, (4096,))]
# xa rounded to bf16 for the expand's dot, then y + delta rounded: a few bf16 ulps.
TOL = {torch.bfloat16: (3e-2, 3e-2), torch.float16: (5e-3, 5e-3)}


@pytest.fixture(autouse=True)
def _triton_on(monkeypatch):
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    monkeypatch.setattr(punica_triton, "LORA_TRITON", True)
    monkeypatch.setattr(punica, "add_lora_torch", _fail("the dense torch path"))
    monkeypatch.setattr(punica, "add_lora_grouped", _fail("the grouped path"))


def _fail(what):
    def fail(*args, **kwargs):
        raise AssertionError(f"add_lora took {what}")

    return fail


def _weights(in_features, sizes, g, dtype=BF16):
    starts = (0, *[sum(sizes[: j + 1]) for j in range(len(sizes))])
    lora_a = _randn(SLOTS + 1, len(sizes) * RANK, in_features, g=g, dtype=dtype,
                    scale=in_features**-0.5)  # fmt: skip
    lora_b = _randn(SLOTS + 1, RANK, starts[-1], g=g, dtype=dtype, scale=0.2)
    lora_a[SLOTS] = 0
    lora_b[SLOTS] = 0
    return lora_a, lora_b, starts


def _slots(num_tokens, g, high=SLOTS):
    """-1 and slots in [0, high): slots at and above ``high`` get no token."""
    slots = torch.randint(-1, high, (num_tokens,), generator=g)
    slots[0] = -1
    return slots.cuda()


@pytest.mark.parametrize("num_tokens", TOKENS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}-{s[1]}")
def test_triton_path_matches_reference_and_dense_path(shape, num_tokens):
    in_features, sizes = shape
    g = _gen(num_tokens + sum(sizes) + in_features)
    lora_a, lora_b, starts = _weights(in_features, sizes, g)
    x = _randn(num_tokens, in_features, g=g, dtype=BF16)
    y0 = _randn(num_tokens, starts[-1], g=g, dtype=BF16)
    token_slots = _slots(num_tokens, g)
    y = y0.clone()
    add_lora(y, x, token_slots, lora_a, lora_b, starts)
    torch.cuda.synchronize()
    assert not torch.isnan(y).any()
    want = reference_add_lora(y0, x, token_slots, lora_a, lora_b, starts)
    torch.testing.assert_close(y.double(), want, rtol=TOL[BF16][0], atol=TOL[BF16][1])
    skipped = token_slots < 0
    assert torch.equal(y[skipped], y0[skipped]), "a row without an adapter changed"
    dense = y0.clone()
    add_lora_torch(dense, x, token_slots, lora_a, lora_b, starts)
    torch.testing.assert_close(y, dense, rtol=TOL[BF16][0], atol=TOL[BF16][1])


@pytest.mark.parametrize("slots", ["one slot", "no adapter", "fp16"])
def test_one_slot_no_adapter_and_fp16_steps(slots):
    g = _gen(5)
    dtype = torch.float16 if slots == "fp16" else BF16
    lora_a, lora_b, starts = _weights(4096, (4096, 1024, 1024), g, dtype)
    x = _randn(200, 4096, g=g, dtype=dtype)
    y0 = _randn(200, starts[-1], g=g, dtype=dtype)
    token_slots = {"one slot": torch.full((200,), 7), "no adapter": torch.full((200,), -1),
                   "fp16": _slots(200, g).cpu()}[slots].cuda()  # fmt: skip
    y = y0.clone()
    add_lora(y, x, token_slots, lora_a, lora_b, starts)
    want = reference_add_lora(y0, x, token_slots, lora_a, lora_b, starts)
    torch.testing.assert_close(y.double(), want, rtol=TOL[dtype][0], atol=TOL[dtype][1])


@pytest.mark.parametrize("num_tokens", TOKENS)
def test_triton_add_lora_in_a_cuda_graph(num_tokens):
    g = _gen(100 + num_tokens)
    lora_a, lora_b, starts = _weights(4096, (4096, 1024, 1024), g)
    x = _randn(num_tokens, 4096, g=g, dtype=BF16)
    y_base = _randn(num_tokens, starts[-1], g=g, dtype=BF16)
    y = torch.empty_like(y_base)
    token_slots = _slots(num_tokens, g, high=12)

    def step():
        y.copy_(y_base)
        add_lora(y, x, token_slots, lora_a, lora_b, starts)

    step()  # warm-up outside the graph: compiles the kernels
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    token_slots.copy_(_slots(num_tokens, g))
    lora_a[3].copy_(_randn(*lora_a.shape[1:], g=g, dtype=BF16, scale=4096**-0.5))
    lora_b[3].copy_(_randn(*lora_b.shape[1:], g=g, dtype=BF16, scale=0.2))
    x.copy_(_randn(num_tokens, 4096, g=g, dtype=BF16))
    graph.replay()
    torch.cuda.synchronize()
    want = reference_add_lora(y_base, x, token_slots, lora_a, lora_b, starts)
    torch.testing.assert_close(y.double(), want, rtol=TOL[BF16][0], atol=TOL[BF16][1])


def test_a_capture_without_eager_launch_takes_another_path(monkeypatch):
    """No layer launched eagerly in this process: the capture must not compile Triton
    kernels (module loading is not allowed while capturing); the grouped path (Hopper) or the
    dense one serves it."""
    monkeypatch.setattr(punica_triton, "_launched", set())
    monkeypatch.setattr(punica, "add_lora_torch", add_lora_torch)
    monkeypatch.setattr(punica, "add_lora_grouped", add_lora_grouped)
    taken = []
    monkeypatch.setattr(punica, "add_lora_triton", lambda *a, **k: taken.append(1))
    g = _gen(11)
    lora_a, lora_b, starts = _weights(1024, (1024, 256, 256), g)
    x = _randn(200, 1024, g=g, dtype=BF16)
    y = _randn(200, starts[-1], g=g, dtype=BF16)
    y0 = y.clone()
    token_slots = _slots(200, g)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        add_lora(y, x, token_slots, lora_a, lora_b, starts)
    assert taken == []
    y.copy_(y0)
    graph.replay()
    torch.cuda.synchronize()
    want = reference_add_lora(y0, x, token_slots, lora_a, lora_b, starts)
    torch.testing.assert_close(y.double(), want, rtol=TOL[BF16][0], atol=TOL[BF16][1])


def test_lora_linear_with_the_triton_path_in_a_graph():
    """An eager call (compiles, makes a grouping), a capture (its own grouping), an eager step
    with other slots in between, then the replay with those slots."""
    g = _gen(9)
    num_tokens, in_features, sizes = 200, 1024, (1024, 256, 256)
    slots = LoRASlots(SLOTS, RANK, max_num_tokens=512, device=torch.device("cuda"))
    base = nn.Linear(in_features, sum(sizes), bias=False, device="cuda", dtype=BF16)
    layer = LoRALinear(base, ("q", "k", "v"), sizes, slots, BF16)
    lora_a, lora_b, starts = _weights(in_features, sizes, g)
    layer.lora_a.copy_(lora_a)
    layer.lora_b.copy_(lora_b)
    x = _randn(num_tokens, in_features, g=g, dtype=BF16)
    slots.token_slots[:num_tokens].copy_(_slots(num_tokens, g, high=12))
    with torch.no_grad():
        layer(x)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = layer(x)
        new_slots = _slots(num_tokens, g)
        slots.token_slots[:num_tokens].copy_(new_slots)
        layer(x)
        graph.replay()
        torch.cuda.synchronize()
        want = reference_add_lora(base(x), x, new_slots, layer.lora_a, layer.lora_b, starts)
    torch.testing.assert_close(out.double(), want, rtol=TOL[BF16][0], atol=TOL[BF16][1])
