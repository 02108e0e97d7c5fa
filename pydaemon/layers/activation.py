"""SwiGLU activation on the fused gate/up projection's output.

CUDA tensors run the pagedd ``silu_and_mul`` kernel (pydaemon/ops/activation.py) when
``_core`` has it; everything else runs the torch expression, which the kernel is tested
against.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pydaemon import ops


class SiluAndMul(nn.Module):
    """``silu(gate) * up`` for ``x = cat([gate, up], -1)``: [..., 2*d] -> [..., d]."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda and x.dtype in ops.LAYER_KERNEL_DTYPES and ops.is_available():
            rows = x.reshape(-1, x.shape[-1])  # [rows, 2*d]
            return ops.silu_and_mul(rows).view(*x.shape[:-1], x.shape[-1] // 2)
        return self.forward_native(x)

    @staticmethod
    def forward_native(x: torch.Tensor) -> torch.Tensor:
        d = x.shape[-1] // 2
        return F.silu(x[..., :d]) * x[..., d:]
