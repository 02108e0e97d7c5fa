"""The batched LoRA torch path (shrink + expand over adapter slots) against a float64 loop."""

from __future__ import annotations

import itertools

import pytest
import torch

from pydaemon.layers.lora.punica import add_lora


@pytest.mark.parametrize("num_tokens", [1, 2, 3, 5, 40])  # gathered (2T <= 4 slots) and dense
@pytest.mark.parametrize("sizes", [(24,), (16, 8, 8)])  # one part (o/down), packed (qkv)
@pytest.mark.parametrize("num_active", [None, 3])  # all slots, or the runner's bound
def test_add_lora_matches_per_token_loop(num_tokens, sizes, num_active):
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
    add_lora(y, x, slots, lora_a, lora_b, starts, num_active)  # on the CPU: the torch path
    torch.testing.assert_close(y, expected, rtol=1e-12, atol=1e-12)
