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

Above that bound, with ``LORA_TRITON`` (on), fp16/bf16 CUDA steps take the Triton SGMV
kernels (pydaemon/layers/lora/punica_triton.py: two launches a layer over the step's slot
grouping, tiles sized for ~12 tokens a slot and K = R), where the dense path does S times the
shrink's and expand's FLOPs: W1 over 32 adapters of 32 slots on the H200 ran 0.88x the base
model against 0.82x dense. ``LORA_GROUPED`` (off: measured slower than dense) would take
torch._grouped_mm grouped GEMMs instead (pydaemon/layers/lora/punica_grouped.py). A layer
whose shapes suit neither keeps the dense path.

The choice depends on the token count, dtype and device only (never on a device value), so a
captured CUDA graph holds one of the paths for its shapes. CPU, float32 and large steps
elsewhere take the torch path, which is also the kernels' test oracle.

With ``LORA_OVERLAP_SHRINK`` (on: measured on the H200), a layer captured into a CUDA graph forks
its shrink onto a side stream before its base GEMM (``fork_lora_shrink``) and joins it before
the expand (``expand_forked``): the shrink depends only on x, so the graph holds it as a
branch parallel to the GEMM, and only the expand stays on the decode step's critical path.
"""

from __future__ import annotations

import torch

from pydaemon import ops
from pydaemon.layers.lora import punica_grouped, punica_triton
from pydaemon.layers.lora.punica_grouped import Grouping, add_lora_grouped, grouped_layout_ok
from pydaemon.layers.lora.punica_torch import add_lora_torch
from pydaemon.layers.lora.punica_triton import add_lora_triton

# Above this many tokens the dense torch path (every slot's weights read once) is used. With
# 512, W1 over 8 adapters (decode steps of ~400 tokens) ran 0.81x plain on the H200 against
# 0.83x with the dense path there: each token re-reading its adapter's A from L2 costs more
# than one GEMM over every slot at that size. 64 keeps the kernels for small decode batches
# (batch 1: 1.24x plain TPOT against 1.68x); the crossover itself is not measured yet.
LORA_KERNEL_MAX_TOKENS = 64
_KERNEL_DTYPES = (torch.float16, torch.bfloat16)
# Batch-1 decode with a rank-16 adapter on all 7 projections ran 1.24x the base TPOT on the
# H200 (256 extra launches a step, mostly the serial latency of tiny kernels). With the shrink
# overlapped with the base GEMM it runs 1.14x (6.26 -> 5.75 ms, bench_lora.py --mode tpot,
# 2026-12-02): on.
LORA_OVERLAP_SHRINK = True


def add_lora(
    y: torch.Tensor,  # [T, sum(out_j)], updated in place
    x: torch.Tensor,  # [T, in], lora_a's dtype
    token_slots: torch.Tensor,  # [T] int64: each token's slot, -1 = no adapter
    lora_a: torch.Tensor,  # [S + 1, n * R, in]: part j's A at rows [j * R, (j + 1) * R)
    lora_b: torch.Tensor,  # [S + 1, R, sum(out_j)]: part j's B.T * scaling in its columns
    part_starts: tuple[int, ...],  # n + 1 column offsets: part j = [starts[j], starts[j + 1])
    num_slots: int | None = None,  # tokens use slots below this (default S; torch path only)
    slot_ids: torch.Tensor | None = None,  # arange(S) on the device (torch path only)
    grouping: Grouping | None = None,  # the step's slot grouping (segmented paths only)
) -> None:
    if _can_use_kernels(x, y):
        xa = ops.lora_shrink(x, lora_a, token_slots)  # [T, n * R] float32
        ops.lora_expand(y, xa, lora_b, part_starts, token_slots)
        return
    if uses_triton_path(x) and punica_triton.ready(y, x, lora_a, lora_b, part_starts):
        add_lora_triton(y, x, token_slots, lora_a, lora_b, part_starts, grouping)
        return
    if uses_grouped_path(x) and grouped_layout_ok(y, x, lora_a, lora_b, part_starts):
        add_lora_grouped(y, x, token_slots, lora_a, lora_b, part_starts, grouping)
        return
    add_lora_torch(y, x, token_slots, lora_a, lora_b, part_starts, num_slots, slot_ids)


def fork_lora_shrink(
    x: torch.Tensor,  # [T, in], lora_a's dtype
    token_slots: torch.Tensor,  # [T] int64: each token's slot, -1 = no adapter
    lora_a: torch.Tensor,  # [S + 1, n * R, in]
    side_stream: torch.cuda.Stream | None,
) -> torch.Tensor | None:
    """Starts xa = x @ A[slot].T on ``side_stream`` and returns xa [T, n * R] float32, to be
    passed to ``expand_forked`` after the base GEMM; None when the layer takes ``add_lora``
    (the switch off, no side stream, the torch path, or not capturing a CUDA graph).

    Only under graph capture: there the fork and join cost nothing at replay, while an eager
    step would pay their host time (stream switches, two events: ~10 us a layer) for a gap
    of a few microseconds on the GPU.
    """
    if not (
        LORA_OVERLAP_SHRINK
        and side_stream is not None
        and _can_use_kernels(x)
        and torch.cuda.is_current_stream_capturing()
    ):
        return None
    main = torch.cuda.current_stream(x.device)
    # Allocated on the main stream, before the fork: the caching allocator hands this block to
    # later main-stream work only, which the join orders after the shrink (no record_stream).
    xa = torch.empty(x.shape[0], lora_a.shape[1], dtype=torch.float32, device=x.device)
    side_stream.wait_stream(main)  # x is ready: the side branch starts here
    with torch.cuda.stream(side_stream):
        ops.lora_shrink(x, lora_a, token_slots, out=xa)
    return xa


def expand_forked(
    y: torch.Tensor,  # [T, sum(out_j)], updated in place (the base GEMM's output)
    xa: torch.Tensor,  # [T, n * R] float32: fork_lora_shrink's
    x: torch.Tensor,  # [T, in]: the shrink's input (for the torch path only)
    token_slots: torch.Tensor,  # [T] int64
    lora_a: torch.Tensor,  # [S + 1, n * R, in]
    lora_b: torch.Tensor,  # [S + 1, R, sum(out_j)]
    part_starts: tuple[int, ...],  # n + 1 column offsets
    side_stream: torch.cuda.Stream,
) -> None:
    """Joins ``fork_lora_shrink``'s branch, then y += xa @ B[slot] (the kernel, or the torch
    path when y does not suit it; every fork is joined, as a capture requires)."""
    torch.cuda.current_stream(y.device).wait_stream(side_stream)
    if _can_use_kernels(x, y):
        ops.lora_expand(y, xa, lora_b, part_starts, token_slots)
    else:
        add_lora_torch(y, x, token_slots, lora_a, lora_b, part_starts)


def uses_grouped_path(x: torch.Tensor) -> bool:
    """Steps of x's token count, dtype and device take a path over the step's slot grouping
    (the Triton or the grouped one, unless a layer's shapes do not suit it): above the
    kernels' bound, punica_triton.use_triton or punica_grouped.use_grouped."""
    return x.shape[0] > LORA_KERNEL_MAX_TOKENS and (
        punica_triton.use_triton(x) or punica_grouped.use_grouped(x)
    )


def uses_triton_path(x: torch.Tensor) -> bool:
    """Steps of x's token count, dtype and device take the Triton SGMV kernels (unless a
    layer's shapes do not suit them, or a capture meets a layer not compiled yet)."""
    return x.shape[0] > LORA_KERNEL_MAX_TOKENS and punica_triton.use_triton(x)


def _can_use_kernels(x: torch.Tensor, y: torch.Tensor | None = None) -> bool:
    """y None: whether x suits the kernels (before the base GEMM has made y)."""
    return (
        x.is_cuda
        and x.shape[0] <= LORA_KERNEL_MAX_TOKENS
        and x.dtype in _KERNEL_DTYPES
        and x.stride(-1) == 1
        and (y is None or (y.dtype == x.dtype and y.stride(-1) == 1))
        and ops.is_available()
    )
