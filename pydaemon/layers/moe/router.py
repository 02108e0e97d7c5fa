"""Top-k expert selection (the router's second half): router logits -> (weights, expert ids).

As transformers computes it: the logits (the gate's output, in the model dtype) are scored in
float32, softmax over all experts (Mixtral, Qwen2/3-MoE) or sigmoid per expert, the k largest
scores are taken, and with ``renormalize`` divided by their sum. The weights stay float32 (the
expert outputs are combined in float32). On CUDA with pagedd's kernels this is one kernel
(pydaemon/ops/moe.py: ties go to the lower expert id); elsewhere torch ops (graph-safe too).
"""

from __future__ import annotations

import torch

from pydaemon import ops

SCORING_FUNCS = ("softmax", "sigmoid")


def select_experts(
    router_logits: torch.Tensor,  # [T, E] any float dtype
    top_k: int,
    scoring: str = "softmax",
    renormalize: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:  # ([T, k] float32, [T, k] int32)
    if scoring not in SCORING_FUNCS:
        raise ValueError(f"unsupported scoring {scoring!r}: expected one of {SCORING_FUNCS}")
    if not 1 <= top_k <= router_logits.shape[-1]:
        raise ValueError(f"top_k ({top_k}) must be in [1, {router_logits.shape[-1]}]")
    if router_logits.is_cuda and ops.moe_kernels_available():
        return ops.topk_route(router_logits, top_k, scoring == "softmax", renormalize)
    return select_experts_native(router_logits, top_k, scoring, renormalize)


def select_experts_native(
    router_logits: torch.Tensor, top_k: int, scoring: str = "softmax", renormalize: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    logits = router_logits.float()
    scores = logits.softmax(dim=-1) if scoring == "softmax" else logits.sigmoid()
    weights, ids = torch.topk(scores, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids.to(torch.int32)
