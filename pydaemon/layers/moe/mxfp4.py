"""MXFP4 experts (gpt-oss): e2m1 weights with one e8m0 scale per 32 input columns
(pydaemon/quantization/mxfp4.py), optional per-expert biases, stacked over the experts:

    w13_weight [E, 2I, H / 2] uint8   w13_weight_scale [E, 2I, H / 32] uint8   w13_bias [E, 2I]
    w2_weight  [E, H, I / 2]  uint8   w2_weight_scale  [E, H, I / 32]  uint8   w2_bias  [E, H]

(I: this rank's intermediate size; gate rows then up rows, de-interleaved at load.) The
experts run as the int4 ones (int4.py): the Triton MoE kernels on CUDA (w4a16_moe.py, MXFP4
decoding in registers), each expert dequantized elsewhere. The biases are added to each
expert's product (the down bias on rank 0 only: the ranks' partial sums are all-reduced).
Biases exist when the model asks for them (FusedMoE's ``has_bias``, gpt-oss); the Mixtral and Qwen
MoE models have none.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from pydaemon.layers.moe import w4a16_moe
from pydaemon.layers.moe.int4 import experts_dequantized
from pydaemon.quantization.mxfp4 import BLOCK

if TYPE_CHECKING:
    from pydaemon.config.weight_only_format import Mxfp4Checkpoint


class Mxfp4MoEMethod:
    """Creates and applies a FusedMoE layer's MXFP4 weights."""

    def __init__(self, checkpoint: Mxfp4Checkpoint | None = None) -> None:
        self.checkpoint = checkpoint
        self.own_dtype_params: tuple[str, ...] = ()

    def create_weights(
        self, layer: nn.Module, num_experts: int, hidden_size: int, intermediate: int
    ) -> None:
        e, h, i = num_experts, hidden_size, intermediate
        if h % BLOCK or i % BLOCK:
            raise ValueError(
                f"MXFP4 experts need input sizes (per tensor-parallel rank) that are multiples "
                f"of {BLOCK} (one scale per {BLOCK} columns); this layer has hidden_size {h}, "
                f"intermediate {i}: the tensor-parallel size splits a block of the down "
                "projection"
            )

        def param(*shape: int, dtype: torch.dtype | None = None) -> nn.Parameter:
            return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)

        layer.w13_weight = param(e, 2 * i, h // 2, dtype=torch.uint8)
        layer.w13_weight_scale = param(e, 2 * i, h // BLOCK, dtype=torch.uint8)
        layer.w2_weight = param(e, h, i // 2, dtype=torch.uint8)
        layer.w2_weight_scale = param(e, h, i // BLOCK, dtype=torch.uint8)
        self.own_dtype_params = ("w13_weight", "w13_weight_scale", "w2_weight", "w2_weight_scale")
        self.has_bias = layer.has_bias
        if self.has_bias:  # in the model dtype
            layer.w13_bias = param(e, 2 * i)
            layer.w2_bias = param(e, h)

    def weights(self, layer: nn.Module, proj: str) -> w4a16_moe.ExpertWeights:
        bias = getattr(layer, f"{proj}_bias") if self.has_bias else None
        return w4a16_moe.ExpertWeights(
            getattr(layer, f"{proj}_weight"),
            getattr(layer, f"{proj}_weight_scale"),
            None,
            None,
            bias,
            "mxfp4",
        )

    def apply(
        self,
        layer: nn.Module,
        x: torch.Tensor,  # [T, H]
        topk_weights: torch.Tensor,  # [T, k] float32
        topk_ids: torch.Tensor,  # [T, k] int32
    ) -> torch.Tensor:  # [T, H], x's dtype
        w13, w2 = self.weights(layer, "w13"), self.weights(layer, "w2")
        if w4a16_moe.supports(x):
            return w4a16_moe.fused_experts(x, w13, w2, topk_weights, topk_ids, layer.act_fn)
        return experts_dequantized(x, w13, w2, topk_weights, topk_ids, layer.act_fn)
