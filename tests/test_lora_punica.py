"""The batched LoRA torch path (shrink + expand over adapter slots) against a float64 loop."""

from __future__ import annotations

import itertools

import pytest
import torch

from pydaemon.layers.lora.punica import add_lora


@pytest.mark.parametrize("num_tokens", [1, 2, 3, 5, 40])  # gathered (2T <= 4 slots) and dense
@pytest.mark.parametrize("sizes", [(24,), (16, 8, 8)])  # one part (o/down), packed (qkv)
@pytest.mark.parametrize("num_active", [None, 3])  # all slots, or the runner's bound
@pytest.mark.parametrize("slot_ids", [False, True])  # the mask's arange made here or given
def test_add_lora_matches_per_token_loop(num_tokens, sizes, num_active, slot_ids):
    g = torch.Generator().manual_seed(num_tokens)
    num_slots, rank, in_features = 4, 8, 32
    n = len(sizes)
    lora_a = torch.randn(num_slots + 1, n * rank, in_features, generator=g, dtype=torch.float64)
    starts = (0, *itertools.accumulate(sizes))
    lora_b = torch.randn(num_slots + 1, rank, starts[-1], generator=g, dtype=torch.float64)
    lora_a[num_slots] = 0  # the zero slot, as LoRALinear keeps it
    lora_b[num_slots] = 0
    x = torch.randn(num_tokens, in_features, generator=g, dtype=torch.float64)
    slots = torch.randint(-1, num_active or num_slots, (num_tokens,), generator=g)
    slots[0] = -1  # at least one token without an adapter
    y = torch.randn(num_tokens, sum(sizes), generator=g, dtype=torch.float64)
    expected = y.clone()
    for t in range(num_tokens):
        s = int(slots[t])
        if s < 0:
            continue
        for j in range(n):
            xa = lora_a[s, j * rank : (j + 1) * rank] @ x[t]
            expected[t, starts[j] : starts[j + 1]] += xa @ lora_b[s, :, starts[j] : starts[j + 1]]
    ids = torch.arange(num_slots) if slot_ids else None  # LoRASlots.slot_ids: every slot
    add_lora(y, x, slots, lora_a, lora_b, starts, num_active, ids)  # on the CPU: the torch path
    torch.testing.assert_close(y, expected, rtol=1e-12, atol=1e-12)


# ---- the shrink beside the base GEMM (punica.LORA_OVERLAP_SHRINK), its order of work ----------


class _FakeStream:
    """Stands for a CUDA stream on the CPU: records the waits between streams."""

    def __init__(self, name: str, log: list) -> None:
        self.name, self.log = name, log

    def wait_stream(self, other: _FakeStream) -> None:
        self.log.append(("wait", self.name, other.name))


def _fake_streams(monkeypatch, log: list):
    """Current-stream tracking and kernel stand-ins that log which stream they run on."""
    from contextlib import contextmanager

    from pydaemon.layers.lora import lora_linear, punica
    from pydaemon.layers.lora.punica_torch import add_lora_torch

    main, side = _FakeStream("main", log), _FakeStream("side", log)
    current = [main]

    @contextmanager
    def on(stream):
        current.append(stream)
        yield
        current.pop()

    def shrink(x, lora_a, token_slots, out=None):
        log.append(("shrink", current[-1].name))
        has = (token_slots >= 0).unsqueeze(1)
        a = lora_a[token_slots.clamp(min=0)]  # [T, n * R, in]
        xa = torch.where(has, torch.bmm(a, x.unsqueeze(2)).squeeze(2), 0)
        return xa if out is None else out.copy_(xa)

    def expand(y, xa, lora_b, part_starts, token_slots):
        log.append(("expand", current[-1].name))
        rank = lora_b.shape[1]
        for t in range(y.shape[0]):
            s = int(token_slots[t])
            for j in range(len(part_starts) - 1) if s >= 0 else ():
                cols = slice(part_starts[j], part_starts[j + 1])
                y[t, cols] += xa[t, j * rank : (j + 1) * rank].to(y.dtype) @ lora_b[s, :, cols]

    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current[-1])
    monkeypatch.setattr(torch.cuda, "stream", on)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    monkeypatch.setattr(lora_linear, "_is_capturing", lambda x: True)
    monkeypatch.setattr(punica, "_can_use_kernels", lambda x, y=None: True)
    monkeypatch.setattr(punica.ops, "lora_shrink", shrink)
    monkeypatch.setattr(punica.ops, "lora_expand", expand)
    return side, add_lora_torch


@pytest.mark.parametrize("overlap", [True, False])
def test_captured_layer_forks_the_shrink_before_the_gemm_and_joins_before_the_expand(
    monkeypatch, overlap
):
    """With the switch on, a captured layer's shrink goes on the side stream after it waited
    for x, the GEMM on the main stream, and the main stream waits for the shrink before the
    expand; off, all of it on the main stream, in order. The deltas are the same."""
    from torch import nn

    from pydaemon.layers.lora import punica
    from pydaemon.layers.lora.lora_linear import LoRALinear, LoRASlots

    log: list = []
    side, add_lora_torch = _fake_streams(monkeypatch, log)
    monkeypatch.setattr(punica, "LORA_OVERLAP_SHRINK", overlap)
    g = torch.Generator().manual_seed(1)
    base = nn.Linear(32, 24, bias=False, dtype=torch.float64)
    base.register_forward_hook(lambda *a: log.append(("gemm", torch.cuda.current_stream().name)))
    slots = LoRASlots(max_loras=3, max_lora_rank=4, max_num_tokens=8, device=torch.device("cpu"))
    slots.shrink_stream = side
    layer = LoRALinear(base, ("q", "k", "v"), (8, 8, 8), slots, torch.float64)
    layer.lora_a[:3] = torch.randn(3, 12, 32, generator=g, dtype=torch.float64)
    layer.lora_b[:3] = torch.randn(3, 4, 24, generator=g, dtype=torch.float64)
    slots.token_slots[:5] = torch.tensor([2, -1, 0, 2, 1])
    x = torch.randn(5, 32, generator=g, dtype=torch.float64)

    y = layer(x)

    if overlap:
        assert log == [("wait", "side", "main"), ("shrink", "side"), ("gemm", "main"),
                       ("wait", "main", "side"), ("expand", "main")]  # fmt: skip
    else:
        assert log == [("gemm", "main"), ("shrink", "main"), ("expand", "main")]
    want = base(x)
    add_lora_torch(want, x, slots.token_slots[:5], layer.lora_a, layer.lora_b, layer.part_starts)
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5)  # xa is float32 (as the kernel's)


def test_no_fork_on_the_cpu_or_when_not_capturing(monkeypatch):
    from pydaemon.layers.lora import punica

    monkeypatch.setattr(punica, "LORA_OVERLAP_SHRINK", True)
    x = torch.randn(2, 16, dtype=torch.bfloat16)
    lora_a = torch.zeros(3, 8, 16, dtype=torch.bfloat16)
    slots = torch.tensor([0, -1])
    assert punica.fork_lora_shrink(x, slots, lora_a, side_stream=None) is None
    assert punica.fork_lora_shrink(x, slots, lora_a, side_stream=object()) is None  # CPU
