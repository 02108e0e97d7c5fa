"""Gated activations on the fused gate/up projection's output, on the GPU: SiLU-and-multiply,
Gemma's GeGLU (tanh GeLU) and gpt-oss's clamped SwiGLU, one kernel each."""

from __future__ import annotations

import torch

from pydaemon.ops._core_ext import arg, core, stream_handle

# name -> pagedd::cuda::GatedActivation
GATED_ACTIVATIONS: dict[str, int] = {"silu": 0, "gelu_tanh": 1, "swigluoai": 2}


def silu_and_mul(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """out = silu(gate) * up for x = cat([gate, up], -1), rounded as torch does.

    x:       [num_tokens, 2 * d] fp16/bf16/fp32, last dim contiguous
    out:     optional [num_tokens, d], last dim contiguous (not x)
    returns  out
    """
    return gated_act_and_mul(x, "silu", out=out)


def gated_act_and_mul(
    x: torch.Tensor,
    activation: str,
    alpha: float = 1.702,
    limit: float = 7.0,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """out = act(gate, up) for x = cat([gate, up], -1), each op rounded where torch's
    expression rounds. ``activation``: "silu" (silu(gate) * up), "gelu_tanh" (gelu(gate,
    approximate="tanh") * up) or "swigluoai" ((clamp(up, -limit, limit) + 1) * g *
    sigmoid(alpha * g), g = min(gate, limit): transformers' GptOssExperts).

    x:       [num_tokens, 2 * d] fp16/bf16/fp32, last dim contiguous
    out:     optional [num_tokens, d], last dim contiguous (not x)
    returns  out
    """
    if activation not in GATED_ACTIVATIONS:
        raise ValueError(
            f"activation must be one of {sorted(GATED_ACTIVATIONS)}, got {activation!r}"
        )
    num_tokens, width = x.shape
    if out is None:
        out = torch.empty(num_tokens, width // 2, dtype=x.dtype, device=x.device)
    core().silu_and_mul(
        arg(out), arg(x), stream_handle(x.device), GATED_ACTIVATIONS[activation], float(alpha),
        float(limit),
    )  # fmt: skip
    return out
