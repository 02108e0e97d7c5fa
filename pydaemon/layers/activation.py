"""Gated activations on the fused gate/up projection's output: SwiGLU (``SiluAndMul``) and
Gemma's GeGLU with the tanh-approximated GeLU (``GeluTanhAndMul``).

CUDA tensors run the pagedd ``silu_and_mul`` kernel (pydaemon/ops/activation.py) when
``_core`` has it; everything else runs the torch expression, which the kernel is tested
against.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pydaemon import ops
from pydaemon.quantization.fp8 import Fp8Activation, quantize_per_token


class SiluAndMul(nn.Module):
    """``silu(gate) * up`` for ``x = cat([gate, up], -1)``: [..., 2*d] -> [..., d].

    ``fp8_out=True`` (x: [T, 2*d]) returns the product quantized per token for an FP8 linear
    layer (``Fp8Activation``), in the same kernel on CUDA."""

    def forward(self, x: torch.Tensor, fp8_out: bool = False) -> torch.Tensor | Fp8Activation:
        kernel = x.is_cuda and x.dtype in ops.LAYER_KERNEL_DTYPES and ops.is_available()
        if fp8_out:
            if kernel and x.stride(-1) == 1:
                return Fp8Activation(*ops.silu_and_mul_fp8_quant(x), x.dtype)
            return Fp8Activation(*quantize_per_token(self.forward(x)), x.dtype)
        if kernel:
            rows = x.reshape(-1, x.shape[-1])  # [rows, 2*d]
            return ops.silu_and_mul(rows).view(*x.shape[:-1], x.shape[-1] // 2)
        return self.forward_native(x)

    @staticmethod
    def forward_native(x: torch.Tensor) -> torch.Tensor:
        d = x.shape[-1] // 2
        return F.silu(x[..., :d]) * x[..., d:]


class GeluTanhAndMul(nn.Module):
    """``gelu_tanh(gate) * up`` for ``x = cat([gate, up], -1)``: [..., 2*d] -> [..., d], as
    transformers' ``gelu_pytorch_tanh`` (each of the two ops rounded to x's dtype); one pagedd
    kernel on CUDA."""

    def forward(self, x: torch.Tensor, fp8_out: bool = False) -> torch.Tensor | Fp8Activation:
        kernel = x.is_cuda and x.dtype in ops.LAYER_KERNEL_DTYPES and ops.is_available()
        if fp8_out:
            if kernel and x.stride(-1) == 1:
                return Fp8Activation(*ops.silu_and_mul_fp8_quant(x, "gelu_tanh"), x.dtype)
            return Fp8Activation(*quantize_per_token(self.forward(x)), x.dtype)
        if kernel:
            rows = x.reshape(-1, x.shape[-1])  # [rows, 2*d]
            return ops.gated_act_and_mul(rows, "gelu_tanh").view(*x.shape[:-1], x.shape[-1] // 2)
        return self.forward_native(x)

    @staticmethod
    def forward_native(x: torch.Tensor) -> torch.Tensor:
        d = x.shape[-1] // 2
        return F.gelu(x[..., :d], approximate="tanh") * x[..., d:]


def gated_activation(hidden_act: str) -> nn.Module:
    """The fused-gate/up activation module for config.json's ``hidden_act``."""
    if hidden_act == "silu":
        return SiluAndMul()
    if hidden_act == "gelu_pytorch_tanh":
        return GeluTanhAndMul()
    raise ValueError(f"unsupported hidden_act {hidden_act!r}")
