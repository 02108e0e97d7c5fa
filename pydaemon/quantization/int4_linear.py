"""4-bit integer linear layers (W4A16): the weights in the engine's int4 layout (int4.py),
the activations in the model dtype, one product:

    y = x[:, perm] @ dequantize(qweight, scales, qzeros).T   (+ bias)

- CUDA, fp16 / bf16 activations, triton importable: the Triton mixed-input kernels
  (w4a16.py), which read the packed weights and dequantize them in registers: a GEMV for
  decode-sized steps (at most ``w4a16.GEMV_MAX_TOKENS`` rows), a tensor-core GEMM above.
- elsewhere (the CPU, and the oracle of the GPU path): the weights dequantized in float32
  (exact), cast to the activation dtype, and ``F.linear``.

A row-parallel layer of a GPTQ act-order checkpoint under tensor parallelism has its groups
scattered over every rank's input columns, so its shard cannot be regrouped into runs: such
a layer (``dense``) is dequantized at load into an ordinary ``weight`` [out, in] in the model
dtype (more memory and bytes for those layers; logged at load).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from pydaemon.quantization import w4a16
from pydaemon.quantization.int4 import PACK, dequantize_int4

if TYPE_CHECKING:
    from pydaemon.config.weight_only_format import Int4Checkpoint


class Int4LinearMethod:
    """Creates and applies a linear layer's int4 parameters: ``qweight`` [out, in / 8] int32,
    ``scales`` [out, in / G] (``scale_dtype``), ``qzeros`` [out, in / G] uint8 (asymmetric
    formats) and ``perm`` [in] int32 (act-order). ``checkpoint``: the format they load from."""

    takes_fp8_input = False

    def __init__(
        self,
        checkpoint: Int4Checkpoint,
        scale_dtype: torch.dtype,
        dense: bool = False,
    ) -> None:
        self.checkpoint = checkpoint
        self.scale_dtype = scale_dtype
        self.dense = dense  # dequantized at load into ``weight`` (see the module docstring)
        self.own_dtype_params: tuple[str, ...] = ()

    def group_size(self, in_features: int) -> int:
        return self.checkpoint.group_size or in_features

    def create_weights(self, layer: nn.Module, out_features: int, in_features: int) -> None:
        if self.dense:
            layer.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
            return
        group = self.group_size(in_features)
        if in_features % group or in_features % PACK:
            raise ValueError(
                f"a {self.checkpoint.quant_method} layer with {in_features} input columns (per "
                f"tensor-parallel rank) does not split into groups of {group}: the "
                "tensor-parallel size must keep every group of input columns on one rank"
            )

        def param(*shape: int, dtype: torch.dtype) -> nn.Parameter:
            return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)

        num_groups = in_features // group
        layer.qweight = param(out_features, in_features // PACK, dtype=torch.int32)
        layer.scales = param(out_features, num_groups, dtype=self.scale_dtype)
        names = ["qweight", "scales"]
        if self.checkpoint.has_zero_point:
            layer.qzeros = param(out_features, num_groups, dtype=torch.uint8)
            names.append("qzeros")
        if self.checkpoint.desc_act:
            layer.perm = param(in_features, dtype=torch.int32)
            names.append("perm")
        self.own_dtype_params = tuple(names)

    def apply(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:  # x: [..., in] -> [..., out], x's dtype
        if self.dense:
            return F.linear(x, layer.weight, bias)
        x2d = x.reshape(-1, x.shape[-1])
        qzeros = layer.qzeros if self.checkpoint.has_zero_point else None
        perm = layer.perm if self.checkpoint.desc_act else None
        if w4a16.supports(x2d):
            out = w4a16.linear(x2d, layer.qweight, layer.scales, qzeros, perm)
        else:
            if perm is not None:
                x2d = x2d.index_select(1, perm.long())
            weight = dequantize_int4(layer.qweight, layer.scales, qzeros, x.dtype)
            out = F.linear(x2d, weight)
        if bias is not None:
            out = out + bias
        return out.view(*x.shape[:-1], out.shape[-1])
