"""Rotary position embeddings (default, linear, Llama-3 and YaRN scaling), as transformers
does.

inv_freq and cos/sin are computed in float32 (like HF: YaRN's cos and sin are multiplied by
its attention factor there too) and cast to the activation dtype only when applied, with the
rotate_half convention, so that greedy decoding matches HF exactly. A partial rotary
embedding (``rotary_dim < head_dim``) rotates the first ``rotary_dim`` dims of each head and
passes the rest through, as transformers' models with ``partial_rotary_factor`` do.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from pydaemon import ops
from pydaemon.config.rope import RopeScaling


def compute_inv_freq(rotary_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    """[rotary_dim // 2] float32 inverse frequencies."""
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).to(torch.float32) / rotary_dim
    inv_freq = 1.0 / (theta**exponents)
    if scaling is None:
        return inv_freq
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    if scaling.rope_type == "yarn":
        return _yarn_inv_freq(rotary_dim, theta, scaling)
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


def _yarn_inv_freq(dim: int, base: float, scaling: RopeScaling) -> torch.Tensor:
    """transformers' _compute_yarn_parameters, step for step (float64 host math for the
    correction range, float32 tensors)."""

    def correction_dim(num_rotations: float) -> float:
        original = scaling.original_max_position_embeddings
        return (dim * math.log(original / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(scaling.beta_fast), correction_dim(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # prevent a singularity, as transformers does
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (scaling.factor * pos_freqs)
    extrapolation_factor = 1 - ramp
    return interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class RotaryEmbedding(nn.Module):
    """Computes cos/sin for the step's positions; applied to q/k by ``apply_rotary_qk``.

    ``rotary_dim``: the dims of each head it rotates (the head size, unless partial)."""

    def __init__(
        self, rotary_dim: int, theta: float, scaling: RopeScaling | None, device=None
    ) -> None:
        super().__init__()
        if rotary_dim < 2 or rotary_dim % 2:
            raise ValueError(f"rotary_dim must be even and >= 2, got {rotary_dim}")
        self.rotary_dim = rotary_dim
        self.theta = theta
        self.scaling = scaling
        # YaRN's mscale multiplies cos and sin (transformers' attention_scaling).
        self.attention_factor = scaling.attention_factor if scaling is not None else 1.0
        self.register_buffer("inv_freq", torch.empty(0), persistent=False)
        self.reset_parameters(device)

    def reset_parameters(self, device: torch.device | str | None = None) -> None:
        """(Re)compute inv_freq on ``device`` (the loader calls it after materialising)."""
        inv_freq = compute_inv_freq(self.rotary_dim, self.theta, self.scaling)
        if device is not None and torch.device(device).type != "meta":
            inv_freq = inv_freq.to(device)
        self.inv_freq = inv_freq

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # positions: [T] int64 -> cos, sin: [T, rotary_dim] float32
        freqs = positions[:, None].float() * self.inv_freq[None, :].float()
        emb = torch.cat((freqs, freqs), dim=-1)
        if self.attention_factor != 1.0:
            return emb.cos() * self.attention_factor, emb.sin() * self.attention_factor
        return emb.cos(), emb.sin()


def apply_rotary_qk(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotates q [T, Hq, D] and k [T, Hk, D] by cos, sin [T, rotary_dim] float32 (the first
    rotary_dim dims of each head): on CUDA with the pagedd kernel, in place and in one launch
    (the same numbers as the torch expression below); elsewhere in torch."""
    if q.is_cuda and q.dtype in ops.LAYER_KERNEL_DTYPES and ops.is_available():
        ops.rotary_embedding(q, k, cos, sin)
        return q, k
    return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [T, H, D]; cos, sin: [T, rotary_dim] float32, cast to x's dtype as HF does.
    cos = cos.to(x.dtype)[:, None, :]
    sin = sin.to(x.dtype)[:, None, :]
    rotary_dim = cos.shape[-1]
    if rotary_dim == x.shape[-1]:
        return (x * cos) + (rotate_half(x) * sin)
    x_rot, x_pass = x[..., :rotary_dim], x[..., rotary_dim:]
    return torch.cat(((x_rot * cos) + (rotate_half(x_rot) * sin), x_pass), dim=-1)
