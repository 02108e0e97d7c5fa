"""apply_grammar_bitmask: a step's token bitmask -> -inf on the logits of disallowed tokens.

The bitmask is xgrammar's layout: int32 [num_rows, ceil(vocab / 32)], bit ``t % 32`` of word
``t // 32`` set when token ``t`` is allowed. Applied with a few batched torch operations on
the logits' device (not one launch per row); the unpacked mask is uint8 (a byte per token:
32 MiB for 256 rows of a 128k vocabulary).
"""

from __future__ import annotations

import torch

_SHIFTS: dict[torch.device, torch.Tensor] = {}


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """bitmask: [num_rows, ceil(vocab / 32)] int32 -> [num_rows, vocab_size] bool, allowed."""
    shifts = _SHIFTS.get(bitmask.device)
    if shifts is None:
        shifts = torch.arange(8, dtype=torch.uint8, device=bitmask.device)
        _SHIFTS[bitmask.device] = shifts
    # Little-endian words: token 32 w + 8 b + k is bit k of byte 4 w + b.
    as_bytes = bitmask.contiguous().view(torch.uint8)  # [num_rows, 4 * words]
    bits = (as_bytes.unsqueeze(-1) >> shifts) & 1  # [num_rows, 4 * words, 8] uint8
    return bits.flatten(1)[:, :vocab_size].bool()


def apply_grammar_bitmask(
    logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None = None
) -> None:
    """In place. logits: [num_logits_rows, vocab] float32; bitmask: [num_masked,
    ceil(vocab / 32)] int32 on logits' device; rows: [num_masked] int64 on the device, the
    logits row of each bitmask row (None: every row, in order)."""
    allowed = unpack_bitmask(bitmask, logits.shape[1])
    if rows is None:
        logits.masked_fill_(~allowed, float("-inf"))
        return
    logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))
