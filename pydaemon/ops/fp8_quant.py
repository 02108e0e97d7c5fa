"""Dynamic per-token FP8 quantization of activations, on the GPU (one kernel)."""

from __future__ import annotations

import torch

from pydaemon.ops._core_ext import core, stream_handle


def per_token_fp8_quant(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (xq, scale), bit for bit pydaemon/quantization/fp8.py's torch quantize_per_token.

    x:       [num_tokens, d] fp16/bf16/fp32, last dim contiguous
    returns  xq [num_tokens, d] float8_e4m3fn, scale [num_tokens, 1] float32
    """
    num_tokens, d = x.shape
    xq = torch.empty(num_tokens, d, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty(num_tokens, 1, dtype=torch.float32, device=x.device)
    core().per_token_fp8_quant(xq.view(torch.uint8), scale.view(-1), x, stream_handle(x.device))
    return xq, scale
