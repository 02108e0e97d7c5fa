"""SiLU-and-multiply on the fused gate/up projection's output, on the GPU."""

from __future__ import annotations

import torch

from pydaemon.ops._core_ext import arg, core, stream_handle


def silu_and_mul(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """out = silu(gate) * up for x = cat([gate, up], -1), rounded as torch does.

    x:       [num_tokens, 2 * d] fp16/bf16/fp32, last dim contiguous
    out:     optional [num_tokens, d], last dim contiguous (not x)
    returns  out
    """
    num_tokens, width = x.shape
    if out is None:
        out = torch.empty(num_tokens, width // 2, dtype=x.dtype, device=x.device)
    core().silu_and_mul(arg(out), arg(x), stream_handle(x.device))
    return out
