"""Mixture-of-experts kernels on the GPU (cpp/cuda/moe_kernels.cu): top-k routing, grouping
slots by expert, weighted combine. The torch code they replace is in pydaemon/layers/moe/."""

from __future__ import annotations

import torch

from pydaemon.ops._core_ext import arg, core, is_available, stream_handle


def moe_kernels_available() -> bool:
    """The GPU kernels run here and ``_core`` was built with the MoE kernels."""
    return is_available() and hasattr(core(), "moe_align")


def topk_route(
    logits: torch.Tensor, top_k: int, softmax: bool, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] fp16/bf16/fp32, last dim contiguous -> (weights [T, k] float32, ids
    [T, k] int32), experts by descending score, ties to the lower id."""
    t = logits.shape[0]
    weights = torch.empty(t, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(t, top_k, dtype=torch.int32, device=logits.device)
    core().topk_route(
        arg(weights), arg(ids), arg(logits), softmax, renormalize, stream_handle(logits.device)
    )
    return weights, ids


def moe_align(
    topk_ids: torch.Tensor, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """topk_ids [T, k] int32 contiguous -> (sorted_token_ids [T * k], inverse [T * k],
    expert_offsets [E]), all int32 (pydaemon/layers/moe/align.py)."""
    n = topk_ids.numel()
    device = topk_ids.device
    sorted_token_ids = torch.empty(n, dtype=torch.int32, device=device)
    inverse = torch.empty(n, dtype=torch.int32, device=device)
    offsets = torch.empty(num_experts, dtype=torch.int32, device=device)
    core().moe_align(
        arg(sorted_token_ids), arg(inverse), arg(offsets), arg(topk_ids), stream_handle(device)
    )
    return sorted_token_ids, inverse, offsets


def moe_combine(
    expert_out: torch.Tensor, inverse: torch.Tensor, topk_weights: torch.Tensor
) -> torch.Tensor:
    """expert_out [T * k, H], inverse [T * k] int32, topk_weights [T, k] float32 -> [T, H]."""
    out = torch.empty(
        topk_weights.shape[0], expert_out.shape[1], dtype=expert_out.dtype, device=expert_out.device
    )
    core().moe_combine(
        arg(out), arg(expert_out), arg(inverse), arg(topk_weights), stream_handle(out.device)
    )
    return out
