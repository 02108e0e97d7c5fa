"""The sparse MoE block of a decoder layer: router, routed experts, optional shared expert.

    logits = gate(x)                          [T, E], the model dtype (as transformers)
    out    = experts(x, logits)               top-k routing in float32 (layer.py)
           + sigmoid(shared_expert_gate(x)) * shared_expert(x)     (Qwen2-MoE only)

gpt-oss: the router has a bias (``moe.router_bias``), the experts biases and the clamped SwiGLU
(``moe.activation``); its checkpoint calls the router ``router`` (the model renames ``gate``).

Tensor parallel: the router and the shared expert's gate are replicated (tiny, unquantized);
the routed experts and the shared expert (a SwiGLU MLP: gate/up column-parallel, down
row-parallel) each give this rank's partial sum; the sum of both is all-reduced once.
Parameter names equal the checkpoint's: ``gate``, ``experts.{e}.*``, ``shared_expert.*``,
``shared_expert_gate``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from pydaemon.distributed import parallel_state as ps
from pydaemon.layers.activation import SiluAndMul
from pydaemon.layers.moe.activation import MoeActivation
from pydaemon.layers.moe.layer import FusedMoE
from pydaemon.layers.parallel_linear import (
    MergedColumnParallelLinear,
    RowParallelLinear,
    takes_fp8_input,
)

if TYPE_CHECKING:
    from pydaemon.config.moe import MoeConfig
    from pydaemon.quantization.config import Fp8Config


class SharedExpertMLP(nn.Module):
    """SwiGLU MLP whose output is this rank's partial sum (no all-reduce of its own)."""

    def __init__(
        self, hidden_size: int, intermediate_size: int, quant_config: Fp8Config | None
    ) -> None:
        super().__init__()
        parts = {"gate_proj": intermediate_size, "up_proj": intermediate_size}
        what = "shared_expert_intermediate_size"
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden_size, parts, False, what, quant_config
        )
        self.down_proj = RowParallelLinear(
            intermediate_size, hidden_size, False, what, quant_config
        )
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H] partial
        a = self.act_fn(self.gate_up_proj(x), fp8_out=takes_fp8_input(self.down_proj))
        return self.down_proj.matmul(a, None)


class SparseMoeBlock(nn.Module):
    def __init__(
        self, hidden_size: int, moe: MoeConfig, quant_config: Fp8Config | None = None
    ) -> None:
        super().__init__()
        self.gate = nn.Linear(hidden_size, moe.num_experts, bias=moe.router_bias)
        self.experts = FusedMoE(
            moe.num_experts,
            moe.top_k,
            hidden_size,
            moe.intermediate_size,
            renormalize=moe.renormalize,
            scoring=moe.scoring,
            expert_names=moe.expert_names,
            reduce_results=False,
            quant_config=quant_config,
            activation=MoeActivation(moe.activation, moe.swiglu_alpha, moe.swiglu_limit),
            has_bias=moe.has_bias,
            checkpoint_layout=moe.checkpoint_layout,
        )
        self.shared_expert: SharedExpertMLP | None = None
        self.shared_expert_gate: nn.Linear | None = None
        if moe.shared_expert_intermediate_size:
            self.shared_expert = SharedExpertMLP(
                hidden_size, moe.shared_expert_intermediate_size, quant_config
            )
            self.shared_expert_gate = nn.Linear(hidden_size, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
        out = self.experts(x, self.gate(x))
        if self.shared_expert is not None:
            shared = self.shared_expert(x)
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * shared
        return ps.all_reduce(out)
