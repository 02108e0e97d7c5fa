"""The experts' activation on the fused gate/up output ``h = [gate | up]`` [rows, 2 * I]:

- ``silu`` (Mixtral, Qwen-MoE): ``silu(gate) * up`` (layers/activation.py's SiluAndMul);
- ``swigluoai`` (gpt-oss, vLLM's name): ``(clamp(up, -limit, limit) + 1) * g * sigmoid(alpha
  * g)`` with ``g = min(gate, limit)``, each op rounded to the activation dtype as
  transformers' GptOssExperts computes it (the checkpoint interleaves gate and up columns; the
  loader de-interleaves them, so both activations read the same halves).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pydaemon import ops
from pydaemon.config.moe import MOE_ACTIVATIONS
from pydaemon.layers.activation import SiluAndMul

_silu_and_mul = SiluAndMul()


@dataclass(frozen=True)
class MoeActivation:
    name: str = "silu"  # one of MOE_ACTIVATIONS
    alpha: float = 1.702  # swigluoai: the sigmoid's gain
    limit: float = 7.0  # swigluoai: the clamp

    def __post_init__(self) -> None:
        if self.name not in MOE_ACTIVATIONS:
            raise ValueError(
                f"unsupported MoE activation {self.name!r}: expected one of {MOE_ACTIVATIONS}"
            )

    @property
    def is_silu(self) -> bool:
        return self.name == "silu"

    def __call__(self, h: torch.Tensor) -> torch.Tensor:  # [rows, 2 * I] -> [rows, I]
        if self.is_silu:
            return _silu_and_mul(h)
        if h.is_cuda and h.dtype in ops.LAYER_KERNEL_DTYPES and ops.is_available():
            return ops.gated_act_and_mul(h, "swigluoai", self.alpha, self.limit)  # one kernel
        return swiglu_oai(h, self.alpha, self.limit)


SILU = MoeActivation()


def swiglu_oai(h: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """h: [..., 2 * I] = [gate | up] -> [..., I]."""
    i = h.shape[-1] // 2
    gate = h[..., :i].clamp(max=limit)
    up = h[..., i:].clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))
