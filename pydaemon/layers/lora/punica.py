"""``add_lora``: the LoRA deltas of a step's tokens, each with its own adapter slot, added to a
layer's output; the fused CUDA kernels where they win, the torch path everywhere else.

On CUDA, for fp16/bf16 and up to ``LORA_KERNEL_MAX_TOKENS`` tokens, two launches per layer
(pydaemon/ops/lora.py): ``lora_shrink`` (xa = x @ A[slot].T, float32) and ``lora_expand``
(y += xa @ B[slot] over every part's columns at once). They replace the torch path's 8-11
small kernels a wrapper (gathers, bmm, adds per part), which made batch-1 decode with an
adapter 1.68x the base TPOT on an H200, and its dense path over every slot, which decode
graphs above 16 tokens took (W1 over 8 adapters of 32 slots: 0.83x plain). Each token reads
its own adapter's weights, mostly from L2 when few adapters are active; with many tokens the
dense GEMMs of pydaemon/layers/lora/punica_torch.py read each slot once and win.

The choice depends on the token count, dtype and device only (never on a device value), so a
captured CUDA graph holds one of the two paths for its shapes. CPU, float32 and large steps
take the torch path, which is also the kernels' test oracle.
"""

from __future__ import annotations

import torch

from pydaemon import ops
from pydaemon.layers.lora.punica_torch import add_lora_torch

# Above this many tokens the dense torch path (every slot's weights read once) is used. With
# 512, W1 over 8 adapters (decode steps of ~400 tokens) ran 0.81x plain on the H200 against
# 0.83x with the dense path there: each token re-reading its adapter's A from L2 costs more
# than one GEMM over every slot at that size. 64 keeps the kernels for small decode batches
# (batch 1: 1.24x plain TPOT against 1.68x); the crossover itself is not measured yet.
LORA_KERNEL_MAX_TOKENS = 64
_KERNEL_DTYPES = (torch.float16, torch.bfloat16)


def add_lora(
    y: torch.Tensor,  # [T, sum(out_j)], updated in place
    x: torch.Tensor,  # [T, in], lora_a's dtype
    token_slots: torch.Tensor,  # [T] int64: each token's slot, -1 = no adapter
    lora_a: torch.Tensor,  # [S + 1, n * R, in]: part j's A at rows [j * R, (j + 1) * R)
    lora_b: torch.Tensor,  # [S + 1, R, sum(out_j)]: part j's B.T * scaling in its columns
    part_starts: tuple[int, ...],  # n + 1 column offsets: part j = [starts[j], starts[j + 1])
    num_slots: int | None = None,  # tokens use slots below this (default S; torch path only)
) -> None:
    if _can_use_kernels(y, x):
        xa = ops.lora_shrink(x, lora_a, token_slots)  # [T, n * R] float32
        ops.lora_expand(y, xa, lora_b, part_starts, token_slots)
        return
    add_lora_torch(y, x, token_slots, lora_a, lora_b, part_starts, num_slots)


def _can_use_kernels(y: torch.Tensor, x: torch.Tensor) -> bool:
    return (
        x.is_cuda
        and x.shape[0] <= LORA_KERNEL_MAX_TOKENS
        and x.dtype in _KERNEL_DTYPES
        and y.dtype == x.dtype
        and y.stride(-1) == 1
        and x.stride(-1) == 1
        and ops.is_available()
    )
