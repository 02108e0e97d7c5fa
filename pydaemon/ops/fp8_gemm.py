"""FP8 scaled product for a few rows (decode) on the GPU (cpp/cuda/fp8_gemv.cu)."""

from __future__ import annotations

import torch

from pydaemon.ops._core_ext import arg, core, is_available, stream_handle

FP8_GEMV_MAX_ROWS = 16  # one m16 tile of the FP8 tensor-core mma


def fp8_gemv_available() -> bool:
    """The kernel is built here (compute capability 8.9+ is checked by the kernel's caller)."""
    return is_available() and hasattr(core(), "fp8_gemv")


def fp8_gemv(
    xq: torch.Tensor, x_scale: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor
) -> torch.Tensor:
    """torch._scaled_mm(xq, wq.t(), scale_a=x_scale, scale_b=w_scale.view(1, -1),
    out_dtype=torch.bfloat16) for 1 to 16 rows, as one pass over the weights.

    xq:       [M, K] float8_e4m3fn, M <= 16, K a multiple of 16, rows 16-byte aligned
    x_scale:  [M, 1] or [M] float32
    wq:       [N, K] float8_e4m3fn, contiguous
    w_scale:  [N] float32
    returns   [M, N] bfloat16: (sum_k xq[m, k] * wq[n, k]) * x_scale[m] * w_scale[n]
    """
    out = torch.empty(xq.shape[0], wq.shape[0], dtype=torch.bfloat16, device=xq.device)
    core().fp8_gemv(
        arg(out),
        arg(xq.view(torch.uint8)),
        arg(x_scale.view(-1)),
        arg(wq.view(torch.uint8)),
        arg(w_scale),
        stream_handle(xq.device),
    )
    return out
