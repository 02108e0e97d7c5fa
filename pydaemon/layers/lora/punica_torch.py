"""Batched LoRA in plain torch: every token of a step gets its own adapter's delta.

S-LoRA / Punica's two halves, over the stacked adapters of a layer (``max_loras`` slots plus
one all-zero slot last, for tokens without an adapter):

- shrink: ``xa = x @ A[slot].T`` with A the part's ``lora_A`` (rank ``r`` rows);
- expand: ``y[:, part] += xa @ B[slot]`` with B ``lora_B.T`` pre-multiplied by the scaling.

A layer packing several projections (q/k/v, gate/up) holds their A matrices one under the
other (one shrink for all parts) and their B matrices side by side in one tensor, part j in
the columns ``[part_starts[j], part_starts[j + 1])`` (each part expands into its own columns
of y; here through views of that tensor). Ranks below ``max_lora_rank`` are zero-padded,
which adds exact zeros.

Two ways, chosen by the token count alone (so a CUDA graph captures one of them, and no
value is read back to the host):

- few tokens (``2 * T <= num_slots``, decode): gather each token's A and B and use batched
  matrix-vector products: writes and reads a copy of T adapters' weights, nothing else (above
  S / 2 tokens, reading every slot once costs less);
- more tokens: one GEMM against every slot's A, a mask that keeps each token's own slot, and
  one GEMM per part against every slot's B; the extra FLOPs are ``num_slots * r`` columns,
  small beside the base GEMM, and the launches do not grow with the number of adapters.

``num_slots`` (default: all) bounds the slots in use: the eager runner passes 1 + the highest
slot of the step; a CUDA graph passes all of them.

Both are exact (up to summation order). This is the reference and the CPU path; on CUDA,
``add_lora`` (pydaemon/layers/lora/punica.py) runs the fused kernels instead where they win.
"""

from __future__ import annotations

import torch


def add_lora_torch(
    y: torch.Tensor,  # [T, sum(out_j)], updated in place
    x: torch.Tensor,  # [T, in]
    token_slots: torch.Tensor,  # [T] int64: each token's slot, -1 = no adapter
    lora_a: torch.Tensor,  # [S + 1, n * R, in]: part j's A at rows [j * R, (j + 1) * R)
    lora_b: torch.Tensor,  # [S + 1, R, sum(out_j)]: part j's B.T * scaling in its columns
    part_starts: tuple[int, ...],  # n + 1 column offsets: part j = [starts[j], starts[j + 1])
    num_slots: int | None = None,  # tokens use slots below this (default S)
    slot_ids: torch.Tensor | None = None,  # [>= num_slots] int64: arange, kept by the caller
) -> None:
    if num_slots is None:
        num_slots = lora_a.shape[0] - 1  # the last slot is all zeros
    if 2 * x.shape[0] <= num_slots:
        _add_lora_gathered(y, x, token_slots, lora_a, lora_b, part_starts)
    else:
        _add_lora_dense(y, x, token_slots, lora_a, lora_b, part_starts, num_slots, slot_ids)


def _add_lora_gathered(y, x, token_slots, lora_a, lora_b, part_starts) -> None:
    num_tokens, rank = x.shape[0], lora_b.shape[1]
    num_parts = len(part_starts) - 1
    slots = token_slots  # -1 indexes the last, all-zero slot: no torch.where per layer
    # [T, n * R, in] @ [T, in, 1] -> [T, n * R]
    xa = torch.bmm(lora_a[slots], x.unsqueeze(2)).view(num_tokens, num_parts, 1, rank)
    b = lora_b[slots]  # [T, R, sum(out_j)]: one gather for every part
    for j in range(num_parts):
        start, end = part_starts[j], part_starts[j + 1]
        # [T, 1, R] @ [T, R, out_j] -> [T, out_j]
        y[:, start:end] += torch.bmm(xa[:, j], b[:, :, start:end]).squeeze(1)


def _add_lora_dense(y, x, token_slots, lora_a, lora_b, part_starts, num_slots, slot_ids) -> None:
    """2 + 2n kernels a layer (n parts): they run in every decode graph above the BGMV
    kernels' bound, 32 layers x 4 wrappers a step, so each one counts (the first version,
    with the mask cast and applied over all parts, then each part copied out and its product
    added in a kernel of its own, ran 41 a decoder layer against 22 now)."""
    num_tokens, rank = x.shape[0], lora_b.shape[1]
    num_parts = len(part_starts) - 1
    a_all = lora_a[:num_slots].reshape(num_slots * num_parts * rank, -1)  # a view
    xa = (x @ a_all.T).view(num_tokens, num_slots, num_parts, rank)
    if slot_ids is None:
        slot_ids = torch.arange(num_slots, device=x.device)
    # Each token keeps its own slot's columns; a token without an adapter keeps none.
    own = (token_slots.unsqueeze(1) == slot_ids[:num_slots]).unsqueeze(2)  # [T, S, 1]
    for j in range(num_parts):
        start, end = part_starts[j], part_starts[j + 1]
        # the mask and the part's columns in one kernel, out contiguous: [T, S * R]
        xa_j = torch.where(own, xa[:, :, j], 0).view(num_tokens, num_slots * rank)
        # [S, R, out_j] with rows of stride sum(out_j) -> [S * R, out_j]: still a view
        b_j = lora_b[:num_slots, :, start:end].reshape(num_slots * rank, end - start)
        y[:, start:end].addmm_(xa_j, b_j)  # the product added in the GEMM's epilogue
