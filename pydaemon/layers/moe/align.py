"""Tokens grouped by expert for the grouped GEMMs (vLLM's moe_align, without block padding:
torch._grouped_mm takes groups of any size).

Each token t has k (token, expert) slots s = t * k + j. ``moe_align`` orders the T * k slots by
expert and returns

- ``sorted_token_ids`` [T * k] int32: the token of each row of the expert-ordered batch
  (rows of expert e are [offsets[e - 1], offsets[e]));
- ``inverse`` [T * k] int32: the row that slot s went to (to un-permute);
- ``expert_offsets`` [E] int32: the cumulative end of each expert's rows (torch._grouped_mm's
  ``offs``); an expert with no token has an empty group.

Sizes depend on T and k only, never on the routing, and nothing is read back to the host: a
step captured in a CUDA graph replays with any routing. On CUDA with pagedd's kernels this is
one kernel (the order of rows within an expert is then unspecified; each row's values are not
affected); elsewhere a stable sort.
"""

from __future__ import annotations

import torch

from pydaemon import ops


def moe_align(
    topk_ids: torch.Tensor,  # [T, k] int32
    num_experts: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if topk_ids.is_cuda and ops.moe_kernels_available():
        return ops.moe_align(topk_ids, num_experts)
    return moe_align_native(topk_ids, num_experts)


def moe_align_native(
    topk_ids: torch.Tensor, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    k = topk_ids.shape[1]
    flat = topk_ids.reshape(-1).long()  # [T * k]
    order = torch.argsort(flat, stable=True)  # rows -> slots
    sorted_token_ids = (order // k).to(torch.int32)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    counts = torch.zeros(num_experts, dtype=torch.int32, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
    offsets = torch.cumsum(counts, 0, dtype=torch.int32)
    return sorted_token_ids, inverse.to(torch.int32), offsets
