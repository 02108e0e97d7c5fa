"""Loading gpt-oss's MXFP4 experts (pydaemon/quantization/mxfp4.py) into a FusedMoE layer's
MXFP4 parameters (pydaemon/layers/moe/mxfp4.py).

The checkpoint stores each projection of all experts as one tensor under the experts module
(``{prefix}.gate_up_proj_blocks``, ``_scales``, ``_bias``; ``{prefix}.down_proj_*``); the
gate/up rows are interleaved (gate j is row 2j, up j row 2j + 1). Each tensor is read whole,
de-interleaved into [gate rows; up rows] and sliced to this rank's share: its intermediate rows
of gate and up, its intermediate columns (whole 32-column blocks) of down; the down bias on
rank 0 only (the ranks' partial sums are all-reduced).

Dummy weights: ``fill_dummy`` draws every expert's gate, up and down [N, K] in the order of the
unquantized model's draws and quantizes them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from pydaemon.distributed import parallel_state as ps
from pydaemon.quantization.mxfp4 import BLOCK, quantize_mxfp4

_SUFFIXES = ("blocks", "scales", "bias")


class Mxfp4Target:
    """Checkpoint tensor ``{proj}_{suffix}`` of a FusedMoE layer with MXFP4 experts."""

    def __init__(self, module: Any, proj: str, suffix: str) -> None:
        self.module, self.proj, self.suffix = module, proj, suffix
        self.required = suffix != "bias" or module.quant_method.has_bias

    @property
    def checkpoint_shape(self) -> list[int]:
        m = self.module
        e, h, i = m.num_experts, m.hidden_size, m.intermediate_size
        n, k = (2 * i, h) if self.proj == "gate_up_proj" else (h, i)
        return {"blocks": [e, n, k // BLOCK, 16], "scales": [e, n, k // BLOCK], "bias": [e, n]}[
            self.suffix
        ]

    def _dest(self) -> torch.Tensor | None:
        name = "w13" if self.proj == "gate_up_proj" else "w2"
        attr = {"blocks": "weight", "scales": "weight_scale", "bias": "bias"}[self.suffix]
        if attr == "bias" and not self.module.quant_method.has_bias:
            return None
        return getattr(self.module, f"{name}_{attr}").data

    def load(self, name: str, tensor: Any, shape: Sequence[int], where: str) -> None:
        if list(shape) != self.checkpoint_shape:
            raise ValueError(
                f"tensor {name!r} in {where} has shape {list(shape)}, expected "
                f"{self.checkpoint_shape}"
            )
        dest = self._dest()
        if dest is None:  # a bias the model has no use for
            return
        t = tensor[...].to(dest.device)
        if self.suffix == "blocks":
            t = t.reshape(*t.shape[:2], -1)  # [E, N, K / 2] bytes
        i, rank = self.module.intermediate_per_rank, ps.get_tp_rank()
        start = rank * i
        if self.proj == "gate_up_proj":  # interleaved rows -> [gate; up], this rank's
            gate, up = t[:, 0::2], t[:, 1::2]
            t = torch.cat([gate[:, start : start + i], up[:, start : start + i]], dim=1)
        elif self.suffix == "bias":
            t = t if rank == 0 else torch.zeros_like(t)
        else:  # down: this rank's intermediate columns, whole blocks
            per_col = 2 if self.suffix == "blocks" else BLOCK  # columns per stored element
            t = t[..., start // per_col : (start + i) // per_col]
        dest.copy_(t.to(dest.dtype))

    def finish(self, where: str) -> None:
        """Nothing to do: each tensor is complete when loaded."""


def mxfp4_targets(module_name: str, module: Any) -> dict[str, Mxfp4Target]:
    return {
        f"{module_name}.{proj}_{suffix}": Mxfp4Target(module, proj, suffix)
        for proj in ("gate_up_proj", "down_proj")
        for suffix in _SUFFIXES
    }


def fill_dummy(module: Any, gen: torch.Generator, dtype: torch.dtype) -> None:
    """Random MXFP4 experts: each expert's gate, up and down drawn as the unquantized model's
    (normal, std 0.02, full shape, then this rank's slice) and quantized."""
    for _, e, proj, offset, size, shard in module.expert_parts():
        dim, start, stop, full = shard
        n = full if proj == "w13" else module.hidden_size
        k = module.hidden_size if proj == "w13" else full
        w = torch.empty(n, k, dtype=dtype, device=gen.device).normal_(0.0, 0.02, generator=gen)
        w = w[start:stop] if dim == 0 else w[:, start:stop]
        packed, scales = quantize_mxfp4(w)
        getattr(module, f"{proj}_weight").data[e, offset : offset + size] = packed
        getattr(module, f"{proj}_weight_scale").data[e, offset : offset + size] = scales
    if module.quant_method.has_bias:
        module.w13_bias.data.zero_()
        module.w2_bias.data.zero_()
