"""FP8 (e4m3) experts: per-output-channel weight scales, dynamic per-token activation scales.

Parameters: ``w13_weight`` [E, 2 * I, H] and ``w2_weight`` [E, H, I] float8_e4m3fn,
``w13_weight_scale`` [E, 2 * I] and ``w2_weight_scale`` [E, H] float32; filled at load from
FP8 checkpoints (per-tensor, per-channel or block scales, as the linear layers:
pydaemon/quantization/fp8_loading.py) or quantized from unquantized weights, expert by expert.

    y[r, n] = sum_k xq[r, k] * wq[e, n, k] * x_scale[r] * w_scale[e, n]   (rows r of expert e)

The activations are quantized once per token before the gather (a row's scale is its token's),
the SiLU-and-mul output per row (one kernel with the product on CUDA). The GEMMs:

- ``torch._scaled_grouped_mm`` (row-wise scales, bf16 out) on CUDA Hopper;
- emulation (``quantization="fp8_emulated"``, any device: the CPU tests, and the oracle of the
  GPU path): the same FP8 values dequantized, one float32 product per expert group.
"""

from __future__ import annotations

import torch
from torch import nn

from pydaemon.layers.activation import SiluAndMul
from pydaemon.layers.moe.align import moe_align
from pydaemon.layers.moe.experts import _capability_major, moe_combine, per_expert
from pydaemon.quantization.fp8 import (
    FP8_DTYPE,
    Fp8Activation,
    emulated_scaled_mm,
    quantize_per_token,
)

_act = SiluAndMul()


def _scaled_grouped_mm_ok(x: torch.Tensor) -> bool:
    """torch._scaled_grouped_mm with row-wise float32 scales: Hopper (9.x)."""
    return (
        x.is_cuda
        and hasattr(torch, "_scaled_grouped_mm")
        and _capability_major(x.device.index if x.device.index is not None else 0) == 9
    )


class Fp8MoEMethod:
    """Creates and applies a FusedMoE layer's FP8 weights (vLLM's Fp8MoEMethod)."""

    own_dtype_params = ("w13_weight", "w13_weight_scale", "w2_weight", "w2_weight_scale")

    def __init__(self, emulate: bool, checkpoint=None) -> None:  # checkpoint: its format
        self.emulate = emulate
        self.checkpoint = checkpoint

    def create_weights(
        self, layer: nn.Module, num_experts: int, hidden_size: int, intermediate: int
    ) -> None:
        if not self.emulate and (hidden_size % 16 or intermediate % 16):
            raise ValueError(
                f"quantization='fp8' needs expert sizes (per tensor-parallel rank) that are "
                f"multiples of 16 (FP8 grouped GEMMs); this model has hidden_size "
                f"{hidden_size}, intermediate {intermediate}"
            )
        e, h, i = num_experts, hidden_size, intermediate

        def param(*shape: int, dtype: torch.dtype) -> nn.Parameter:
            return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)

        layer.w13_weight = param(e, 2 * i, h, dtype=FP8_DTYPE)
        layer.w13_weight_scale = param(e, 2 * i, dtype=torch.float32)
        layer.w2_weight = param(e, h, i, dtype=FP8_DTYPE)
        layer.w2_weight_scale = param(e, h, dtype=torch.float32)

    def apply(
        self,
        layer: nn.Module,
        x: torch.Tensor,  # [T, H]
        topk_weights: torch.Tensor,  # [T, k] float32
        topk_ids: torch.Tensor,  # [T, k] int32
    ) -> torch.Tensor:  # [T, H], x's dtype
        sorted_token_ids, inverse, expert_offsets = moe_align(topk_ids, layer.num_experts)
        xq, x_scale = quantize_per_token(x)  # [T, H] fp8, [T, 1]
        index = sorted_token_ids
        rows_q = xq.view(torch.uint8).index_select(0, index).view(FP8_DTYPE)  # [T * k, H]
        rows = Fp8Activation(rows_q, x_scale.index_select(0, index), x.dtype)
        h = self._mm(rows, layer.w13_weight, layer.w13_weight_scale, expert_offsets)
        a = _act(h, fp8_out=True)  # quantized per row
        y = self._mm(a, layer.w2_weight, layer.w2_weight_scale, expert_offsets)
        return moe_combine(y, inverse, topk_weights)

    def _mm(
        self,
        a: Fp8Activation,  # [M, K] rows grouped by expert
        wq: torch.Tensor,  # [E, N, K] fp8
        w_scale: torch.Tensor,  # [E, N] float32
        offsets: torch.Tensor,  # [E] int32
    ) -> torch.Tensor:  # [M, N], a.dtype
        if not self.emulate and _scaled_grouped_mm_ok(a.xq):
            return torch._scaled_grouped_mm(
                a.xq,
                wq.transpose(1, 2),
                a.scale.view(-1),
                w_scale,
                offs=offsets,
                out_dtype=torch.bfloat16,
            ).to(a.dtype)
        out = torch.empty(a.xq.shape[0], wq.shape[1], dtype=a.dtype, device=a.xq.device)

        def expert(rows: slice, e: int) -> torch.Tensor:
            return emulated_scaled_mm(a.xq[rows], a.scale[rows], wq[e], w_scale[e])

        return per_expert(out, offsets, expert)
