"""The engine's 4-bit integer weight layout, into which every int4 checkpoint format (AWQ,
GPTQ, compressed-tensors pack-quantized: awq.py, gptq.py, compressed_tensors_int4.py) is
repacked once at load, and its torch reference (dequantization, round-to-nearest quantization).

For a linear layer of ``N`` outputs and ``K`` inputs, groups of ``G`` input columns
(``G = K``: one group per output channel):

    qweight [N, K / 8] int32   nibble j (bits 4j..4j+3) of qweight[n, i] is q[n, 8i + j], 0..15
    scales  [N, K / G]         float16 / bfloat16 (the checkpoint's)
    qzeros  [N, K / G] uint8   the zero point of each group, 0..15 (absent: 8, symmetric)
    perm    [K] int32          act-order (GPTQ desc_act): column p of the weights above is
                               input column perm[p] (absent: the identity)

    w[n, perm[k]] = (q[n, k] - zero[n, k // G]) * scale[n, k // G]

Each output row's packed input columns are contiguous (compressed-tensors' own layout): a
decode GEMV reads each row as one stream, and a K tile of a row is one 16-byte-aligned run.
Act-order checkpoints are permuted at load so that groups are runs of G columns again; the
activations are read through ``perm`` instead (the kernels gather them; the CPU path indexes).
"""

from __future__ import annotations

import torch

PACK = 8  # 4-bit values per int32
_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)  # [8]


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """q: [..., K] integers in 0..15 -> [..., K / 8] int32, value k % 8 in bits 4 (k % 8)."""
    if q.shape[-1] % PACK:
        raise ValueError(f"pack_int4: {q.shape[-1]} columns are not a multiple of {PACK}")
    q = q.to(torch.int32).reshape(*q.shape[:-1], -1, PACK)
    return (q << _SHIFTS.to(q.device)).sum(dim=-1, dtype=torch.int32)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """packed: [..., K / 8] int32 -> [..., K] uint8 (0..15); pack_int4's inverse."""
    nibbles = (packed[..., None] >> _SHIFTS.to(packed.device)) & 0xF
    return nibbles.reshape(*packed.shape[:-1], -1).to(torch.uint8)


def expand_groups(t: torch.Tensor, k: int) -> torch.Tensor:
    """t: [..., K / G] per group -> [..., K] per input column."""
    return t.repeat_interleave(k // t.shape[-1], dim=-1)


def dequantize_int4(
    qweight: torch.Tensor,  # [N, K / 8] int32
    scales: torch.Tensor,  # [N, K / G]
    qzeros: torch.Tensor | None,  # [N, K / G] uint8, or None: 8
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:  # [N, K] in dtype, columns in the layout's order (before perm)
    """(q - zero) * scale in float32 (exact for float16 / bfloat16 scales), cast to dtype."""
    q = unpack_int4(qweight).to(torch.float32)
    k = q.shape[-1]
    zero = 8.0 if qzeros is None else expand_groups(qzeros.to(torch.float32), k)
    return ((q - zero) * expand_groups(scales.to(torch.float32), k)).to(dtype)


def quantize_int4(
    w: torch.Tensor,  # [N, K] float
    group_size: int,
    symmetric: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Round-to-nearest 4-bit quantization per group of ``group_size`` columns -> (q [N, K]
    uint8 0..15, scales [N, K / G] float32, zeros [N, K / G] uint8). Symmetric: zero 8,
    scale amax / 7.5 over q - 8 in -8..7 (the largest |value| maps to +-7.5 at most, as
    round(7.5) clamps to 7); asymmetric: scale (max - min) / 15, zero round(-min / scale)."""
    n, k = w.shape
    g = w.float().reshape(n, k // group_size, group_size)
    if symmetric:
        scale = (g.abs().amax(dim=-1) / 7.5).clamp(min=1e-10)
        zero = torch.full_like(scale, 8.0)
    else:
        lo = g.amin(dim=-1).clamp(max=0.0)
        hi = g.amax(dim=-1).clamp(min=0.0)
        scale = ((hi - lo) / 15.0).clamp(min=1e-10)
        zero = torch.round(-lo / scale).clamp(0, 15)
    q = torch.round(g / scale[..., None] + zero[..., None]).clamp(0, 15)
    return q.reshape(n, k).to(torch.uint8), scale, zero.to(torch.uint8)


def act_order_permutation(g_idx: torch.Tensor, group_size: int) -> torch.Tensor | None:
    """g_idx: [K] the group of each input column -> perm [K] int64 that sorts the columns by
    group (stable), when the sorted columns form runs of exactly ``group_size`` per group in
    group order (what act-order writes at TP=1); None when they do not (a shard of them)."""
    k = g_idx.numel()
    perm = torch.argsort(g_idx.long(), stable=True)
    expected = torch.arange(k, device=g_idx.device) // group_size
    if not torch.equal(g_idx.long()[perm], expected):
        return None
    return perm
