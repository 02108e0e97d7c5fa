"""Dynamic per-token FP8 quantization of activations, on the GPU (one kernel)."""

from __future__ import annotations

import torch

from pydaemon.ops._core_ext import arg, core, stream_handle
from pydaemon.ops.activation import GATED_ACTIVATIONS


def per_token_fp8_quant(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (xq, scale), bit for bit pydaemon/quantization/fp8.py's torch quantize_per_token.

    x:       [num_tokens, d] fp16/bf16/fp32, last dim contiguous
    returns  xq [num_tokens, d] float8_e4m3fn, scale [num_tokens, 1] float32
    """
    num_tokens, d = x.shape
    xq = torch.empty(num_tokens, d, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty(num_tokens, 1, dtype=torch.float32, device=x.device)
    core().per_token_fp8_quant(
        arg(xq.view(torch.uint8)), arg(scale.view(-1)), arg(x), stream_handle(x.device)
    )
    return xq, scale


def rms_norm_fp8_quant(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    round_once: bool = False,
    weight_offset: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm (with the residual add first when ``residual`` is given, which is then updated
    in place as fused_add_rms_norm does) and per-token FP8 quantization of its output, in one
    kernel: bit for bit per_token_fp8_quant(rms_norm(...)).

    x:        [num_tokens, hidden_size] fp16/bf16/fp32, last dim contiguous
    weight:   [hidden_size], dtype of x
    residual: optional [num_tokens, hidden_size], dtype of x, last dim contiguous
    round_once, weight_offset: the norm's rounding (ops.rms_norm)
    returns   xq [num_tokens, hidden_size] float8_e4m3fn, scale [num_tokens, 1] float32
    """
    num_tokens, hidden_size = x.shape
    xq = torch.empty(num_tokens, hidden_size, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty(num_tokens, 1, dtype=torch.float32, device=x.device)
    stream = stream_handle(x.device)
    if residual is None:
        core().rms_norm_fp8(
            arg(xq.view(torch.uint8)), arg(scale.view(-1)), arg(x), arg(weight), float(eps),
            stream, round_once, float(weight_offset),
        )  # fmt: skip
    else:
        core().fused_add_rms_norm_fp8(
            arg(xq.view(torch.uint8)),
            arg(scale.view(-1)),
            arg(x),
            arg(residual),
            arg(weight),
            float(eps),
            stream,
            round_once,
            float(weight_offset),
        )
    return xq, scale


def silu_and_mul_fp8_quant(
    x: torch.Tensor, activation: str = "silu", alpha: float = 1.702, limit: float = 7.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """silu(gate) * up (or another gated ``activation``, ops/activation.py) for x = cat([gate,
    up], -1) and per-token FP8 quantization of the product, in one kernel: bit for bit
    per_token_fp8_quant(silu_and_mul(x)).

    x:       [num_tokens, 2 * d] fp16/bf16/fp32, last dim contiguous
    returns  xq [num_tokens, d] float8_e4m3fn, scale [num_tokens, 1] float32
    """

    num_tokens, width = x.shape
    xq = torch.empty(num_tokens, width // 2, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty(num_tokens, 1, dtype=torch.float32, device=x.device)
    core().silu_and_mul_fp8(
        arg(xq.view(torch.uint8)), arg(scale.view(-1)), arg(x), stream_handle(x.device),
        GATED_ACTIVATIONS[activation], float(alpha), float(limit),
    )  # fmt: skip
    return xq, scale
