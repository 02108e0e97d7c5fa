"""FusedMoE: the routed experts of a mixture-of-experts layer (vLLM's FusedMoE).

Parameters (this tensor-parallel rank's): ``w13_weight`` [E, 2 * I / tp, H], each expert's
gate rows then its up rows (this rank's slice of each, as MergedColumnParallelLinear), and
``w2_weight`` [E, H, I / tp] (this rank's columns, as RowParallelLinear). Every rank holds a
slice of every expert (vLLM's default); the output is this rank's partial sum, all-reduced
once per layer by the caller (the block adds its shared expert's partial sum first).

Expert parallel (``enable_expert_parallel``: pydaemon/distributed/parallel_state.py): the
experts are partitioned over the tensor-parallel ranks instead, rank r holding the
``num_local_experts`` whole experts from ``expert_start`` (``w13_weight`` [E / ep, 2 * I,
H], ``w2_weight`` [E / ep, H, I]). Dispatch needs no collective: attention leaves every
rank of the group with the same tokens, so each rank routes them all (the router is
replicated) and keeps the slots of its own experts; the combine is the same all-reduce of
partial sums. A slot routed to another rank's expert is given weight 0 and local expert 0
(``local_routing``), so every expert backend (grouped GEMMs, Triton, the decode kernels,
FP8) runs unchanged, at the cost of computing those slots for nothing: a rank does the
GEMM work of all T * k slots on its E / ep experts. Skipping them (vLLM's ``expert_map``:
id -1, left out of the align step) and an all-to-all dispatch (DeepEP-style: each rank sends
only its own tokens to the owners of their experts, which needs data-parallel attention so
that ranks hold different tokens) are the faster designs.

Loading: the checkpoint keeps one tensor per expert and projection (``experts.{e}.gate_proj``
or Mixtral's ``experts.{e}.w1`` ...); ``checkpoint_parts`` says where each goes (the loader,
pydaemon/model_loader/weight_targets.py, stacks them). gpt-oss's checkpoint stacks them per
layer with gate and up interleaved (``checkpoint_layout == "gpt_oss"``:
pydaemon/model_loader/stacked_experts.py de-interleaves and transposes). Quantized
(``quant_config``): FP8 weights and per-channel or block scales (fp8.py), 4-bit integer
weights with group scales (int4.py) or gpt-oss's MXFP4 experts (mxfp4.py); each method
creates its parameters and computes the experts from the routing (``apply(layer, x,
topk_weights, topk_ids)``).

gpt-oss also has expert biases (``has_bias``: ``w13_bias`` [E, 2 * I / tp], this rank's slice
of gate then up as the weight; ``w2_bias`` [E, H], replicated, added by rank 0 only so that
the all-reduced sum holds it once) and its clamped SwiGLU (``activation``: activation.py,
which maps the gate/up product [S, 2 * I], gate columns first, to [S, I]). Quantized experts
take biases and another activation with MXFP4 only (whose method makes the biases).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch
from torch import nn

from pydaemon.distributed import parallel_state as ps
from pydaemon.layers.moe.activation import MoeActivation
from pydaemon.layers.moe.experts import fused_experts
from pydaemon.layers.moe.fp8 import Fp8MoEMethod
from pydaemon.layers.moe.int4 import Int4MoEMethod
from pydaemon.layers.moe.mxfp4 import Mxfp4MoEMethod
from pydaemon.layers.moe.router import SCORING_FUNCS, select_experts

if TYPE_CHECKING:
    from pydaemon.quantization.config import QuantConfig

MoEMethod = Fp8MoEMethod | Int4MoEMethod | Mxfp4MoEMethod


def moe_method(quant_config: QuantConfig) -> MoEMethod:
    """The experts' quantization method of a model quantized as ``quant_config``."""
    if quant_config.kind == "fp8":
        return Fp8MoEMethod(quant_config.emulate, quant_config.checkpoint)
    if quant_config.kind == "int4":
        return Int4MoEMethod(quant_config.checkpoint, quant_config.scale_dtype)
    return Mxfp4MoEMethod(quant_config.checkpoint)


# Checkpoint names of (gate, up, down) in an expert.
QWEN_EXPERT_NAMES = ("gate_proj", "up_proj", "down_proj")
MIXTRAL_EXPERT_NAMES = ("w1", "w3", "w2")


class FusedMoE(nn.Module):
    def __init__(
        self,
        num_experts: int,
        top_k: int,
        hidden_size: int,
        intermediate_size: int,
        *,
        renormalize: bool,
        scoring: str = "softmax",
        expert_names: tuple[str, str, str] = QWEN_EXPERT_NAMES,
        reduce_results: bool = True,
        quant_config: QuantConfig | None = None,
        activation: MoeActivation | None = None,
        has_bias: bool = False,
        checkpoint_layout: str = "per_expert",
    ) -> None:
        super().__init__()
        if scoring not in SCORING_FUNCS:
            raise ValueError(f"unsupported scoring {scoring!r}: expected one of {SCORING_FUNCS}")
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok ({top_k}) must be in [1, {num_experts}]")
        ep = ps.get_ep_world_size()
        tp = 1 if ep > 1 else ps.get_tp_world_size()  # expert parallel: whole experts
        if intermediate_size % tp:
            raise ValueError(
                f"moe_intermediate_size ({intermediate_size}) is not divisible by "
                f"tensor_parallel_size ({tp})"
            )
        if num_experts % ep:
            raise ValueError(
                f"num_experts ({num_experts}) is not divisible by tensor_parallel_size ({ep}): "
                "expert parallelism gives each rank as many whole experts"
            )
        self.num_experts, self.top_k = num_experts, top_k
        self.num_local_experts = num_experts // ep
        self.expert_start = ps.get_ep_rank() * self.num_local_experts
        self.slice_rank = 0 if ep > 1 else ps.get_tp_rank()  # of each expert's intermediate
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.intermediate_per_rank = intermediate_size // tp
        self.renormalize, self.scoring = renormalize, scoring
        self.expert_names = expert_names
        self.reduce_results = reduce_results
        self.activation = activation or MoeActivation()
        self.checkpoint_layout = checkpoint_layout
        self.has_bias = has_bias
        self.quant_method: MoEMethod | None = None
        e, h, i = self.num_local_experts, hidden_size, self.intermediate_per_rank
        self.w13_bias: nn.Parameter | None = None
        self.w2_bias: nn.Parameter | None = None
        is_mxfp4 = quant_config is not None and quant_config.kind == "mxfp4"
        if (has_bias or not self.activation.is_silu) and quant_config is not None and not is_mxfp4:
            raise ValueError(
                "quantized experts with biases or a non-SiLU activation: MXFP4 experts only"
            )
        if has_bias and quant_config is None:  # MXFP4's method makes its own
            self.w13_bias = nn.Parameter(torch.empty(e, 2 * i), requires_grad=False)
            self.w2_bias = nn.Parameter(torch.empty(e, h), requires_grad=False)
        if quant_config is None:
            self.w13_weight = nn.Parameter(torch.empty(e, 2 * i, h), requires_grad=False)
            self.w2_weight = nn.Parameter(torch.empty(e, h, i), requires_grad=False)
        else:
            self.quant_method = moe_method(quant_config)
            self.quant_method.create_weights(self, e, h, i)

    def forward(
        self,
        x: torch.Tensor,  # [T, H]
        router_logits: torch.Tensor,  # [T, E]
    ) -> torch.Tensor:  # [T, H]; this rank's partial sum unless reduce_results
        topk_weights, topk_ids = select_experts(
            router_logits, self.top_k, self.scoring, self.renormalize
        )
        if self.num_local_experts != self.num_experts:  # expert parallel
            topk_weights, topk_ids = local_routing(
                topk_weights, topk_ids, self.expert_start, self.num_local_experts
            )
        if self.quant_method is None:
            # The replicated down bias belongs to the sum over ranks once: rank 0 adds it
            # (expert parallel: each rank holds its own experts' biases, whole, and adds them).
            is_ep = self.num_local_experts != self.num_experts
            w2_bias = self.w2_bias if ps.get_tp_rank() == 0 or is_ep else None
            out = fused_experts(
                x, self.w13_weight, self.w2_weight, topk_weights, topk_ids, self.activation,
                self.w13_bias, w2_bias,
            )  # fmt: skip
        else:
            out = self.quant_method.apply(self, x, topk_weights, topk_ids)
        return ps.all_reduce(out) if self.reduce_results else out

    def checkpoint_parts(
        self,
    ) -> Iterator[tuple[str, torch.Tensor, torch.Tensor | None, tuple[int, int, int, int]]]:
        """-> (checkpoint module under this one, e.g. ``3.gate_proj``; the weight rows it fills
        [rows, cols]; their scales (FP8: [rows] per channel, or [rows / bn, col blocks] per
        block, fp8.py) or None; the slice (dim, start, stop, full_size) of the checkpoint
        tensor this rank reads), expert by expert, gate, up, down: the order dummy weights
        are drawn in."""
        quant = self.quant_method
        for part, e, proj, offset, size, shard in self.expert_parts():
            if proj == "w13":
                weight = self.w13_weight.data[e].narrow(0, offset, size)
                scale = None
                if quant is not None:
                    scale = quant.scale_rows(self.w13_weight_scale.data[e], "w13", offset, size)
            else:
                weight = self.w2_weight.data[e]
                scale = None if quant is None else self.w2_weight_scale.data[e]
            yield part, weight, scale, shard

    def expert_parts(
        self,
    ) -> Iterator[tuple[str, int, str, int, int, tuple[int, int, int, int]]]:
        """-> (checkpoint module under this one, e.g. ``3.gate_proj``; its expert; "w13" or
        "w2"; the first of its rows in that expert's weight and how many; the slice (dim,
        start, stop, full_size) of the checkpoint tensor [out, in] this rank reads), expert by
        expert, gate, up, down."""
        i, full = self.intermediate_per_rank, self.intermediate_size
        start = self.slice_rank * i
        gate, up, down = self.expert_names
        for e in range(self.num_local_experts):
            name_e = self.expert_start + e  # the checkpoint's expert index
            for name, offset in ((gate, 0), (up, i)):
                yield f"{name_e}.{name}", e, "w13", offset, i, (0, start, start + i, full)
            yield f"{name_e}.{down}", e, "w2", 0, self.hidden_size, (1, start, start + i, full)

    def extra_repr(self) -> str:
        return (
            f"num_experts={self.num_experts}, local={self.num_local_experts}, "
            f"top_k={self.top_k}, hidden={self.hidden_size}, "
            f"intermediate={self.intermediate_per_rank}, scoring={self.scoring}, "
            f"renormalize={self.renormalize}, "
            f"quant={type(self.quant_method).__name__ if self.quant_method else None}, "
            f"activation={self.activation.name}, bias={self.has_bias}"
        )


def local_routing(
    topk_weights: torch.Tensor,  # [T, k] float32
    topk_ids: torch.Tensor,  # [T, k] int32, global expert ids
    expert_start: int,
    num_local_experts: int,
) -> tuple[torch.Tensor, torch.Tensor]:  # ([T, k] float32, [T, k] int32 local ids)
    """Expert parallel: a slot of this rank's experts keeps its weight, with its local id;
    another rank's slot gets weight 0 on local expert 0 (computed, then multiplied by 0).
    Device ops only: no host read, graph-safe."""
    local_ids = topk_ids - expert_start
    is_local = (local_ids >= 0) & (local_ids < num_local_experts)
    weights = torch.where(is_local, topk_weights, torch.zeros_like(topk_weights))
    return weights, torch.where(is_local, local_ids, torch.zeros_like(local_ids))
