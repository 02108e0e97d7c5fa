"""RMSNorm, computed exactly as transformers' LlamaRMSNorm, optionally fused with the residual
add before it (vLLM's ``fused_add_rms_norm``); and the two variants other checkpoints need:

- ``round_once`` (gpt-oss's GptOssRMSNorm): ``(weight * x_normalised).to(dtype)``, the
  product in float32 and one rounding, where Llama rounds the normalised x first;
- ``GemmaRMSNorm`` (Gemma 2 / 3): the same with ``(1 + weight)`` (weights stored around 0).

CUDA tensors of the kernels' dtypes run one pagedd kernel (pydaemon/ops/layernorm.py) when
``_core`` has them; everything else (CPU, a build without kernels) runs the torch code below,
which the kernels are tested against.
"""

from __future__ import annotations

import torch
from torch import nn

from pydaemon import ops
from pydaemon.quantization.fp8 import Fp8Activation, quantize_per_token


class RMSNorm(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        eps: float = 1e-6,
        round_once: bool = False,
        weight_offset: float = 0.0,
    ) -> None:
        """``round_once``: scale the float32 normalised x by ``weight + weight_offset`` (in
        float32) and round once (gpt-oss, Gemma); else Llama's rounding."""
        super().__init__()
        if weight_offset and not round_once:
            raise ValueError("a weight offset is only defined with round_once (Gemma)")
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps
        self.round_once = round_once
        self.weight_offset = weight_offset

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None, fp8_out: bool = False
    ) -> torch.Tensor | Fp8Activation | tuple[torch.Tensor | Fp8Activation, torch.Tensor]:
        """Without residual: x [..., hidden_size] -> rmsnorm(x) * weight, same shape.

        With residual (x, residual: [T, hidden_size]): -> (rmsnorm(x + residual) * weight,
        x + residual). The kernel writes the sum into ``residual`` in place and returns it;
        the torch path returns a new tensor: use the returned one.

        ``fp8_out=True`` (x: [T, hidden_size]): the normalised output comes quantized per
        token for an FP8 linear layer (``Fp8Activation``), in the same kernel on CUDA.
        """
        if fp8_out:
            return self._forward_fp8(x, residual)
        if residual is None:
            if self._uses_kernel(x):
                return self._forward_kernel(x)
            return self.forward_native(x)
        if self._uses_kernel(x):
            out = ops.fused_add_rms_norm(
                x, residual, self.weight, self.variance_epsilon, None, *self._rounding()
            )
            return out, residual
        hidden_states = x + residual
        return self.forward_native(hidden_states), hidden_states

    def _forward_fp8(
        self, x: torch.Tensor, residual: torch.Tensor | None
    ) -> Fp8Activation | tuple[Fp8Activation, torch.Tensor]:
        if self._uses_kernel(x) and x.stride(-1) == 1:
            xq, scale = ops.rms_norm_fp8_quant(
                x, self.weight, self.variance_epsilon, residual, *self._rounding()
            )
            out = Fp8Activation(xq, scale, x.dtype)
            return out if residual is None else (out, residual)
        if residual is None:
            return Fp8Activation(*quantize_per_token(self.forward(x)), x.dtype)
        hidden_states, residual = self.forward(x, residual)
        return Fp8Activation(*quantize_per_token(hidden_states), x.dtype), residual

    def forward_native(self, hidden_states: torch.Tensor) -> torch.Tensor:
        # hidden_states: [..., hidden_size]; normalise in float32, cast back, then scale (as HF).
        input_dtype = hidden_states.dtype
        x = hidden_states.to(torch.float32)
        variance = x.pow(2).mean(-1, keepdim=True)
        x = x * torch.rsqrt(variance + self.variance_epsilon)
        if self.round_once:
            return (x * (self.weight.float() + self.weight_offset)).to(input_dtype)
        return self.weight * x.to(input_dtype)

    def _rounding(self) -> tuple[bool, float]:
        return self.round_once, self.weight_offset

    def _uses_kernel(self, x: torch.Tensor) -> bool:
        return (
            x.is_cuda
            and x.dtype in ops.LAYER_KERNEL_DTYPES
            and self.weight.dtype == x.dtype
            and ops.is_available()
        )

    def _forward_kernel(self, x: torch.Tensor) -> torch.Tensor:
        # The kernel takes rows: [..., hidden_size] -> [rows, hidden_size] (a copy only when
        # x's rows are not evenly strided, e.g. Qwen3's per-head q/k norm on a qkv slice).
        rows = x.reshape(-1, x.shape[-1])
        out = ops.rms_norm(rows, self.weight, self.variance_epsilon, None, *self._rounding())
        return out.view(x.shape)


class GemmaRMSNorm(RMSNorm):
    """transformers' Gemma2RMSNorm / Gemma3RMSNorm: ``(x_normalised * (1 + weight)).to(dtype)``,
    all in float32 (the checkpoint's weights sit around 0)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__(hidden_size, eps, round_once=True, weight_offset=1.0)
