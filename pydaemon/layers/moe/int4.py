"""4-bit integer experts (W4A16): each expert's gate/up and down weights in the engine's
int4 layout (pydaemon/quantization/int4.py), stacked over the experts:

    w13_qweight [E, 2I, H / 8] int32    w13_scales [E, 2I, H / G]   w13_qzeros [E, 2I, H / G] u8
    w2_qweight  [E, H, I / 8]  int32    w2_scales  [E, H, I / G]    w2_qzeros  [E, H, I / G]  u8
    w13_perm [E, H], w2_perm [E, I] int32: act-order checkpoints (each expert its own order)

(I: this rank's intermediate size; the zero points only for asymmetric formats.) The experts:

- CUDA, fp16 / bf16, triton importable: the Triton W4A16 MoE kernels (w4a16_moe.py): a GEMV
  per (token, expert) slot for decode-sized steps, a tensor-core GEMM over tokens sorted by
  expert above; the SiLU-and-mul in between and the routing weights in the down GEMM.
- elsewhere: each expert's weights dequantized (float32, exact, cast to x's dtype) and one
  product per expert that has tokens (the CPU tests; the oracle of the GPU path).

Tensor parallel: the down projection's input columns (I) are split; a rank's share must be
whole groups. Act-order experts cannot be split so (their groups are scattered over I).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from pydaemon.distributed import parallel_state as ps
from pydaemon.layers.moe import w4a16_moe
from pydaemon.layers.moe.align import moe_align
from pydaemon.layers.moe.experts import moe_combine, per_expert
from pydaemon.quantization.int4 import PACK, dequantize_int4

if TYPE_CHECKING:
    from pydaemon.config.weight_only_format import Int4Checkpoint


class Int4MoEMethod:
    """Creates and applies a FusedMoE layer's int4 weights."""

    def __init__(self, checkpoint: Int4Checkpoint, scale_dtype: torch.dtype) -> None:
        self.checkpoint = checkpoint
        self.scale_dtype = scale_dtype
        self.own_dtype_params: tuple[str, ...] = ()

    def create_weights(
        self, layer: nn.Module, num_experts: int, hidden_size: int, intermediate: int
    ) -> None:
        ckpt = self.checkpoint
        e, h, i = num_experts, hidden_size, intermediate
        if ckpt.desc_act and ps.get_tp_world_size() > 1:
            raise ValueError(
                f"{ckpt.quant_method} act-order (desc_act / g_idx) experts cannot be split by "
                "tensor parallelism: their groups are scattered over the intermediate columns; "
                "run this checkpoint with tensor_parallel_size=1"
            )
        names = []
        for proj, n, k in (("w13", 2 * i, h), ("w2", h, i)):
            group = ckpt.group_size or k
            if k % group or k % PACK:
                raise ValueError(
                    f"{ckpt.quant_method} experts: the {proj} input size {k} (per "
                    f"tensor-parallel rank) does not split into groups of {group}: the "
                    "tensor-parallel size must keep every group of input columns on one rank"
                )

            def param(*shape: int, dtype: torch.dtype) -> nn.Parameter:
                return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)

            setattr(layer, f"{proj}_qweight", param(e, n, k // PACK, dtype=torch.int32))
            setattr(layer, f"{proj}_scales", param(e, n, k // group, dtype=self.scale_dtype))
            names += [f"{proj}_qweight", f"{proj}_scales"]
            if ckpt.has_zero_point:
                setattr(layer, f"{proj}_qzeros", param(e, n, k // group, dtype=torch.uint8))
                names.append(f"{proj}_qzeros")
            if ckpt.desc_act:
                setattr(layer, f"{proj}_perm", param(e, k, dtype=torch.int32))
                names.append(f"{proj}_perm")
        self.own_dtype_params = tuple(names)

    def weights(self, layer: nn.Module, proj: str) -> w4a16_moe.ExpertWeights:
        """The packed tensors of ``proj`` ("w13" or "w2")."""
        ckpt = self.checkpoint
        return w4a16_moe.ExpertWeights(
            getattr(layer, f"{proj}_qweight"),
            getattr(layer, f"{proj}_scales"),
            getattr(layer, f"{proj}_qzeros") if ckpt.has_zero_point else None,
            getattr(layer, f"{proj}_perm") if ckpt.desc_act else None,
            None,
            "int4",
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


def dequantize_expert(w: w4a16_moe.ExpertWeights, e: int, dtype: torch.dtype) -> torch.Tensor:
    """Expert e's weight [N, K] in dtype, columns in input order (perm undone)."""
    if w.kind == "mxfp4":
        from pydaemon.quantization.mxfp4 import dequantize_mxfp4

        weight = dequantize_mxfp4(w.qweight[e], w.scales[e], torch.float32)
    else:
        zeros = w.qzeros[e] if w.qzeros is not None else None
        weight = dequantize_int4(w.qweight[e], w.scales[e], zeros, torch.float32)
    if w.perm is not None:
        unpermuted = torch.empty_like(weight)
        unpermuted[:, w.perm[e].long()] = weight
        weight = unpermuted
    return weight.to(dtype)


def experts_dequantized(
    x: torch.Tensor,  # [T, H]
    w13: w4a16_moe.ExpertWeights,
    w2: w4a16_moe.ExpertWeights,
    topk_weights: torch.Tensor,  # [T, k] float32
    topk_ids: torch.Tensor,  # [T, k] int32
    act_fn: nn.Module,
) -> torch.Tensor:  # [T, H]
    """The experts with each one's weights dequantized: one product per expert with rows."""
    num_experts = w13.qweight.shape[0]
    sorted_token_ids, inverse, offsets = moe_align(topk_ids, num_experts)
    rows = x.index_select(0, sorted_token_ids)  # [T * k, H]

    def gemm(a: torch.Tensor, w: w4a16_moe.ExpertWeights) -> torch.Tensor:
        out = a.new_empty(a.shape[0], w.qweight.shape[1])

        def expert(r: slice, e: int) -> torch.Tensor:
            y = F.linear(a[r], dequantize_expert(w, e, a.dtype))
            return y if w.bias is None else y + w.bias[e]

        return per_expert(out, offsets, expert)

    h = gemm(rows, w13)  # [T * k, 2I]
    y = gemm(act_fn(h), w2)  # [T * k, H]
    return moe_combine(y, inverse, topk_weights)
