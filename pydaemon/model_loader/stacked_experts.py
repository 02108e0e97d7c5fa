"""gpt-oss's stacked expert tensors -> a FusedMoE layer's parameters.

The checkpoint (transformers' GptOssExperts, bf16) keeps each layer's experts as four tensors:

    experts.gate_up_proj       [E, H, 2 * I]   x @ W: columns 2j (gate j) and 2j + 1 (up j)
    experts.gate_up_proj_bias  [E, 2 * I]      interleaved the same way
    experts.down_proj          [E, I, H]
    experts.down_proj_bias     [E, H]

FusedMoE holds ``w13_weight`` [E, 2 * I / tp, H] (this rank's gate rows, then its up rows),
``w13_bias`` [E, 2 * I / tp], ``w2_weight`` [E, H, I / tp] and ``w2_bias`` [E, H]. A rank owns
columns j in [rank * I / tp, (rank + 1) * I / tp) of gate and of up: columns [2 * start,
2 * stop) of the interleaved tensor, one contiguous slice (read lazily), de-interleaved and
transposed here. MXFP4 checkpoints (``*_blocks`` / ``*_scales``) are the quantized loaders'.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from pydaemon.distributed import parallel_state as ps


class StackedPart(NamedTuple):
    """Where one stacked checkpoint tensor goes (weight_targets.py makes it a WeightTarget):
    ``transform`` maps this rank's slice (``shard``: dim, start, stop, full size) to
    ``dest``'s shape; ``shape`` is the checkpoint tensor's."""

    dest: torch.Tensor
    shard: tuple[int, int, int, int] | None
    transform: Callable[[torch.Tensor], torch.Tensor] | None
    shape: tuple[int, ...]


def _deinterleave(part: torch.Tensor) -> torch.Tensor:
    """[..., 2n] with gate j at 2j, up j at 2j + 1 -> [..., 2n] = [gate | up]."""
    return torch.cat((part[..., 0::2], part[..., 1::2]), dim=-1)


def _deinterleave_transposed(part: torch.Tensor) -> torch.Tensor:  # [E, H, 2n] -> [E, 2n, H]
    return _deinterleave(part).transpose(1, 2)


def _transposed(part: torch.Tensor) -> torch.Tensor:  # [E, n, H] -> [E, H, n]
    return part.transpose(1, 2)


def gpt_oss_expert_parts(module_name: str, module) -> dict[str, StackedPart]:
    """The four checkpoint tensors of ``module`` (a FusedMoE with checkpoint_layout
    "gpt_oss", unquantized) -> where each goes."""
    if module.quant_method is not None:
        raise ValueError(f"{module_name}: gpt-oss experts load unquantized (bf16) weights only")
    e, h = module.num_experts, module.hidden_size
    i, full = module.intermediate_per_rank, module.intermediate_size
    start = ps.get_tp_rank() * i
    interleaved = (2 * start, 2 * (start + i), 2 * full)
    return {
        f"{module_name}.gate_up_proj": StackedPart(
            module.w13_weight.data, (2, *interleaved), _deinterleave_transposed, (e, h, 2 * full)
        ),
        f"{module_name}.gate_up_proj_bias": StackedPart(
            module.w13_bias.data, (1, *interleaved), _deinterleave, (e, 2 * full)
        ),
        f"{module_name}.down_proj": StackedPart(
            module.w2_weight.data, (1, start, start + i, full), _transposed, (e, full, h)
        ),
        f"{module_name}.down_proj_bias": StackedPart(module.w2_bias.data, None, None, (e, h)),
    }
