"""MXFP4 (OCP microscaling FP4), as gpt-oss checkpoints store their experts: e2m1 values
(1 sign, 2 exponent, 1 mantissa bit: 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives), one
shared e8m0 scale 2^(s - 127) per block of 32 consecutive input columns.

Checkpoint tensors of a MoE layer's experts (``model.layers.{i}.mlp.experts.``):

    gate_up_proj_blocks [E, 2I, H / 32, 16] uint8   two values a byte: the even column in the
    gate_up_proj_scales [E, 2I, H / 32]     uint8   low nibble, the odd one in the high
    gate_up_proj_bias   [E, 2I]                     (gpt-oss; rows interleaved: gate j is
    down_proj_blocks    [E, H, I / 32, 16]  uint8    row 2j, up j row 2j + 1)
    down_proj_scales    [E, H, I / 32]      uint8
    down_proj_bias      [E, H]

The engine keeps the bytes as they are, rows [E, N, K / 2] uint8 (so nibble j of each 32-bit
word is column 8i + j, the int4 layout's order: int4.py), the scales [E, N, K / 32], and
de-interleaves the gate/up rows into [gate rows; up rows] at load (pydaemon/model_loader/
mxfp4_loading.py).
"""

from __future__ import annotations

import torch

BLOCK = 32  # columns per e8m0 scale
SCALE_BIAS = 127
E2M1_VALUES = (
    0.0,
    0.5,
    1.0,
    1.5,
    2.0,
    3.0,
    4.0,
    6.0,
    -0.0,
    -0.5,
    -1.0,
    -1.5,
    -2.0,
    -3.0,
    -4.0,
    -6.0,
)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """packed: [..., K / 2] uint8 -> [..., K] uint8 codes (0..15), low nibble first."""
    lo, hi = packed & 0xF, packed >> 4
    return torch.stack([lo, hi], dim=-1).reshape(*packed.shape[:-1], -1)


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """codes: [..., K] 0..15 -> [..., K / 2] uint8; unpack_fp4's inverse."""
    pairs = codes.to(torch.uint8).reshape(*codes.shape[:-1], -1, 2)
    return pairs[..., 0] | (pairs[..., 1] << 4)


def dequantize_mxfp4(
    packed: torch.Tensor,  # [..., K / 2] uint8
    scales: torch.Tensor,  # [..., K / 32] uint8 (e8m0)
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:  # [..., K]
    """e2m1 value * 2^(scale - 127), in float32 (exact: a power of two times a 2-bit
    mantissa, for scales 2^-126 .. 2^127), cast to dtype."""
    lut = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=packed.device)
    values = lut[unpack_fp4(packed).long()]
    k = values.shape[-1]
    exponent = scales.to(torch.int32) - SCALE_BIAS
    exponent = exponent.repeat_interleave(BLOCK, dim=-1)[..., :k]
    return torch.ldexp(values, exponent.to(torch.float32)).to(dtype)


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w: [..., K] float -> (packed [..., K / 2] uint8, scales [..., K / 32] uint8): each block
    scaled by the power of two that brings its largest |value| to at most 6 (e2m1's largest),
    then every value rounded to the nearest e2m1 value (a tie to the smaller magnitude)."""
    k = w.shape[-1]
    blocks = w.float().reshape(*w.shape[:-1], k // BLOCK, BLOCK)
    amax = blocks.abs().amax(dim=-1).clamp(min=2.0**-120)
    exponent = torch.ceil(torch.log2(amax / 6.0)).clamp(-SCALE_BIAS + 1, SCALE_BIAS)
    scaled = blocks / torch.exp2(exponent)[..., None]
    lut = torch.tensor(E2M1_VALUES[:8], dtype=torch.float32, device=w.device)
    # Nearest magnitude; on a tie the smaller one (argmin keeps the first).
    dist = (scaled.abs()[..., None] - lut).abs()
    magnitude = dist.argmin(dim=-1)
    codes = magnitude | ((scaled < 0).to(torch.int64) << 3)
    packed = pack_fp4(codes.reshape(*w.shape[:-1], k))
    return packed, (exponent + SCALE_BIAS).to(torch.uint8)
