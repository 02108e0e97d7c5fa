"""Rotary position embeddings (default, linear and Llama-3 scaling), as transformers does.

inv_freq and cos/sin are computed in float32 (like HF) and cast to the activation dtype only
when applied, with the rotate_half convention, so that greedy decoding matches HF exactly.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from pydaemon import ops
from pydaemon.config.model import RopeScaling


def compute_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    """[head_dim // 2] float32 inverse frequencies."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
    inv_freq = 1.0 / (theta**exponents)
    if scaling is None:
        return inv_freq
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    if scaling.rope_type != "llama3":
        raise ValueError(f"unsupported rope type {scaling.rope_type!r}")
    factor = scaling.factor
    old_context_len = scaling.original_max_position_embeddings
    low_freq_wavelen = old_context_len / scaling.low_freq_factor
    high_freq_wavelen = old_context_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth_factor = (old_context_len / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth_factor) * inv_freq_llama / factor + smooth_factor * inv_freq_llama
    is_medium_freq = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium_freq, smoothed, inv_freq_llama)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class RotaryEmbedding(nn.Module):
    """Computes cos/sin for the step's positions; applied to q/k by ``apply``."""

    def __init__(
        self, head_dim: int, theta: float, scaling: RopeScaling | None, device=None
    ) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.theta = theta
        self.scaling = scaling
        self.register_buffer("inv_freq", torch.empty(0), persistent=False)
        self.reset_parameters(device)

    def reset_parameters(self, device: torch.device | str | None = None) -> None:
        """(Re)compute inv_freq on ``device`` (the loader calls it after materialising)."""
        inv_freq = compute_inv_freq(self.head_dim, self.theta, self.scaling)
        if device is not None and torch.device(device).type != "meta":
            inv_freq = inv_freq.to(device)
        self.inv_freq = inv_freq

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # positions: [T] int64 -> cos, sin: [T, head_dim] float32
        freqs = positions[:, None].float() * self.inv_freq[None, :].float()
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos(), emb.sin()


def apply_rotary_qk(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotates q [T, Hq, D] and k [T, Hk, D]: on CUDA with the pagedd kernel, in place and
    in one launch (the same numbers as the torch expression below); elsewhere in torch."""
    if q.is_cuda and q.dtype in ops.LAYER_KERNEL_DTYPES and ops.is_available():
        ops.rotary_embedding(q, k, cos, sin)
        return q, k
    return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [T, H, D]; cos, sin: [T, D] float32, cast to x's dtype as HF does.
    cos = cos.to(x.dtype)[:, None, :]
    sin = sin.to(x.dtype)[:, None, :]
    return (x * cos) + (rotate_half(x) * sin)
