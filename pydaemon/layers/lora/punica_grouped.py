"""The segmented LoRA path: a step's tokens grouped by adapter slot, as a MoE layer groups its
tokens by expert (pydaemon/layers/moe/experts.py), and two grouped GEMMs
(``torch._grouped_mm``) in which each token meets its own slot's A and B only.

Each token has exactly one slot (top-1, weight 1); a token without an adapter (-1) goes to
the last, all-zero slot S, so every row of the grouped batch is computed (x @ 0 = 0: its row
of y is left as it was, unless x itself holds an inf or NaN, as in the gathered torch path):

    sorted_ids, offsets = slot_grouping(token_slots, S + 1)   once a step, shared by the layers
    xs       = x[sorted_ids]                                  [T, in]  (tokens grouped by slot)
    xa       = xs @ A[slot].T   per slot group                [T, n * R]  (every part at once)
    delta_j  = xa[:, part j] @ B[slot][:, part j]  per group  [T, out_j]
    y[sorted_ids, part j] += delta_j                          (index_add_: one row each)

Against the dense torch path above the BGMV kernels' bound (``_add_lora_dense``: one GEMM of x
against every slot's A, S * n * R columns, and per part one against every slot's B) this does
the FLOPs the tokens need, whatever the number of slots: the dense path's extra FLOPs, about
12-25 % of the base layer's with 32 slots of rank 16 on the Llama-3-8B shape, matched W1's
0.82x of plain. Kernels a layer of n parts: the gather, the shrink (two: torch's argument
kernel and the CUTLASS GEMM), per part the expand (two) and the index_add_: 3 + 3n (qkv 12,
gate/up 9, o and down 6 each: 33 a decoder layer, against 22 for the dense path), plus two a
step for the grouping (a remainder into int32 and ``moe_align``), which ``LoRASlots`` keeps
for every layer of one model forward.

The grouping reads nothing back to the host (``moe_align``: one kernel on CUDA, else a sort;
the group sizes stay on the device) and the shapes depend on T only: graph-capturable, and a
captured graph replays with any slots. torch._grouped_mm runs its CUTLASS kernels for
bfloat16 on Hopper / datacenter Blackwell only (other dtypes: a per-group fallback that reads
the offsets on the host); their TMA loads want 16-byte aligned base pointers and row strides,
so x's width, the rank R and the parts' column offsets must be multiples of 8 elements.
``grouped_layout_ok`` checks that; a layer that fails it keeps the dense path.

``LORA_GROUPED`` (the switch, off: measured slower than the dense path, see below) and ``LORA_GROUPED_MIN_TOKENS`` choose this path in
``add_lora`` (pydaemon/layers/lora/punica.py) for steps above ``LORA_KERNEL_MAX_TOKENS``; both
depend on the token count, dtype and device only, so a captured graph holds one path.
"""

from __future__ import annotations

import torch

from pydaemon.layers.moe.align import moe_align
from pydaemon.layers.moe.experts import use_grouped_mm

# Measured on the H200 (Llama-3-8B shape, rank 16, 32 slots, 2026-12-02): W1 over 32 adapters
# 23.28 s with this path against 15.93 s dense and 14.96 s with the Triton SGMV kernels
# (punica_triton.py): at ~12 tokens a slot torch's CUTLASS tiles (64 x 128 x 128) are mostly
# empty (N = 16-48 of 128 columns in the shrink, K = R = 16 of 128 in the expand). Off; the
# slot grouping below serves the Triton path. A/B:
#   python bench/bench_lora.py --mode w1 --adapters 0,32 --max-loras 32 --lora-grouped 0|1
LORA_GROUPED = False
# Steps of fewer tokens than this keep the dense path (0: every step above the kernels' bound).
LORA_GROUPED_MIN_TOKENS = 0
_ALIGN = 8  # bfloat16 elements in 16 bytes: TMA's alignment of pointers and row strides
_MAX_GROUPS = 1023  # torch._grouped_mm: fewer than 1024 groups (moe_align: up to 1024)

Grouping = tuple[torch.Tensor, torch.Tensor]  # (sorted_ids [T] int32, offsets [S + 1] int32)


def use_grouped(x: torch.Tensor) -> bool:
    """The grouped path serves a step of these tokens (before any layer's layout is checked):
    the switch on, enough tokens, bfloat16 CUDA tensors on a device with the CUTLASS kernels."""
    return LORA_GROUPED and x.shape[0] >= LORA_GROUPED_MIN_TOKENS and use_grouped_mm(x)


def grouped_layout_ok(
    y: torch.Tensor,  # [T, sum(out_j)]
    x: torch.Tensor,  # [T, in]
    lora_a: torch.Tensor,  # [S + 1, n * R, in]
    lora_b: torch.Tensor,  # [S + 1, R, sum(out_j)]
    part_starts: tuple[int, ...],
) -> bool:
    """The layer's shapes suit torch._grouped_mm: one dtype, contiguous weights, x's width,
    the rank and every part's first column multiples of 8 (16-byte aligned views)."""
    return (
        y.dtype == x.dtype == lora_a.dtype == lora_b.dtype
        and lora_a.shape[0] == lora_b.shape[0] <= _MAX_GROUPS
        and lora_a.is_contiguous()
        and lora_b.is_contiguous()
        and x.shape[1] % _ALIGN == 0
        and lora_b.shape[1] % _ALIGN == 0
        and lora_a.shape[1] == (len(part_starts) - 1) * lora_b.shape[1]
        and all(s % _ALIGN == 0 for s in part_starts)
        and part_starts[-1] == lora_b.shape[2] == y.shape[1]
    )


def slot_grouping(
    token_slots: torch.Tensor,  # [T] int64: slots in [0, S), -1 = no adapter
    num_groups: int,  # S + 1: the adapter slots and the zero slot
) -> Grouping:
    """-> (sorted_ids [T] int32: the token of each row of the slot-ordered batch, offsets
    [S + 1] int32: the cumulative end of each slot's rows, the zero slot's (-1) last).
    Two kernels on CUDA with pagedd's (a remainder into int32, ``moe_align``); the order of
    the rows within a slot is then unspecified (each row's values are not affected)."""
    keys = torch.empty(token_slots.shape[0], 1, dtype=torch.int32, device=token_slots.device)
    torch.remainder(token_slots.view(-1, 1), num_groups, out=keys)  # -1 -> S
    sorted_ids, _, offsets = moe_align(keys, num_groups)
    return sorted_ids, offsets


def add_lora_grouped(
    y: torch.Tensor,  # [T, sum(out_j)], updated in place
    x: torch.Tensor,  # [T, in], lora_a's dtype
    token_slots: torch.Tensor,  # [T] int64: each token's slot, -1 = no adapter
    lora_a: torch.Tensor,  # [S + 1, n * R, in]: part j's A at rows [j * R, (j + 1) * R)
    lora_b: torch.Tensor,  # [S + 1, R, sum(out_j)]: part j's B.T * scaling in its columns
    part_starts: tuple[int, ...],  # n + 1 column offsets: part j = [starts[j], starts[j + 1])
    grouping: Grouping | None = None,  # slot_grouping(token_slots, S + 1), if already made
) -> None:
    """y += the LoRA delta of each token's slot (callers check ``grouped_layout_ok``)."""
    if grouping is None:
        grouping = slot_grouping(token_slots, lora_a.shape[0])
    sorted_ids, offsets = grouping
    rank = lora_b.shape[1]
    xs = x.index_select(0, sorted_ids)  # [T, in] contiguous
    # [T, in] @ [S + 1, in, n * R] (A's column-major view) -> [T, n * R], x's dtype
    xa = torch._grouped_mm(xs, lora_a.transpose(1, 2), offs=offsets)
    for j in range(len(part_starts) - 1):
        start, end = part_starts[j], part_starts[j + 1]
        # [T, R] (a view of xa's columns) @ [S + 1, R, out_j] (row-major, stride sum(out_j))
        delta = torch._grouped_mm(xa[:, j * rank : (j + 1) * rank], lora_b[:, :, start:end],
                                  offs=offsets)  # fmt: skip
        y[:, start:end].index_add_(0, sorted_ids, delta)  # each row of y gets one row
