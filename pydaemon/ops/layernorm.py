"""RMSNorm, and residual-add + RMSNorm fused into one kernel, on the GPU."""

from __future__ import annotations

import torch

from pydaemon.ops._core_ext import arg, core, stream_handle


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    out: torch.Tensor | None = None,
    round_once: bool = False,
    weight_offset: float = 0.0,
) -> torch.Tensor:
    """out = weight * rmsnorm(x), rounded as transformers' LlamaRMSNorm (layers/rms_norm.py);
    ``round_once``: round(rmsnorm_f32(x) * (weight + weight_offset)) (gpt-oss; Gemma with
    offset 1).

    x:       [num_tokens, hidden_size] fp16/bf16/fp32, last dim contiguous
    weight:  [hidden_size], dtype of x
    out:     optional [num_tokens, hidden_size], last dim contiguous; may be x (in place)
    returns  out
    """
    if out is None:
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
    core().rms_norm(
        arg(out), arg(x), arg(weight), float(eps), stream_handle(x.device), round_once,
        float(weight_offset),
    )  # fmt: skip
    return out


def fused_add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    out: torch.Tensor | None = None,
    round_once: bool = False,
    weight_offset: float = 0.0,
) -> torch.Tensor:
    """residual = x + residual (in place), then out = weight * rmsnorm(residual): one kernel
    (``round_once``, ``weight_offset``: as rms_norm).

    x:        [num_tokens, hidden_size] fp16/bf16/fp32, last dim contiguous
    residual: [num_tokens, hidden_size], dtype of x, last dim contiguous; updated in place
    weight:   [hidden_size], dtype of x
    out:      optional [num_tokens, hidden_size]; may be x, not residual
    returns   out
    """
    if out is None:
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
    core().fused_add_rms_norm(
        arg(out), arg(x), arg(residual), arg(weight), float(eps), stream_handle(x.device),
        round_once, float(weight_offset),
    )  # fmt: skip
    return out
