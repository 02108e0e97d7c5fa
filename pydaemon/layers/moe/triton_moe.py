"""The experts of a MoE layer as Triton fused-MoE GEMMs (the approach of vLLM's default
fused_moe kernel), an alternative to the grouped GEMMs of experts.py for fp16/bf16 on CUDA:

    sorted, blocks = align(topk_ids)       slots sorted by expert, padded per expert to BLOCK_M
    h   = x[s // k] @ w13[e].T             per slot s, one GEMM over all experts  [S, 2 * I]
    a   = silu(h[:, :I]) * h[:, I:]                                               [S, I]
    y   = weight[s] * (a[s] @ w2[e].T)     weight in the GEMM's epilogue          [S, H]
    out = y.view(T, k, H).sum(1)           float32 sum in a fixed order, rounded once

with S = T * k slots (s = t * k + j). Four launches per layer besides the routing: the align
kernel, the GEMM kernel twice (the same kernel: triton_moe_kernels.py), silu_and_mul, and the
sum. No gather of x (the first GEMM reads each slot's token row) and no un-permute (the second
writes each slot's own row). Nothing is read back to the host: buffers are sized by the most
rows the padding can take, so a captured CUDA graph replays with any routing. The order of
the float32 sums is fixed (by slot), so results do not depend on the routing's order.

Tiles: ``TILE_CONFIGS`` picks one config by the number of tokens T (both GEMMs share
BLOCK_M, the align's padding). The values are UNMEASURED starting points (the shapes vLLM's
published H200 table for E=128, N=768 bf16 uses at those token counts, rounded to five
buckets), to be tuned on the GPU with bench/bench_moe.py --moe-backend triton.

Selected in experts.py (``MOE_BACKEND = "triton"``, off by default); triton is imported only
when this path runs (the CPU install and CI never need it at import time).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from pydaemon.layers.activation import SiluAndMul

_act = SiluAndMul()
TRITON_DTYPES = (torch.float16, torch.bfloat16)


class TileConfig(NamedTuple):
    block_m: int
    block_n: int
    block_k: int
    group_m: int
    num_warps: int
    num_stages: int


# (at most this many tokens, config), first match. UNMEASURED: tune on the H200 (Qwen3-30B-A3B
# shape: E 128, H 2048, I 768, top-8) with bench/bench_moe.py --moe-backend triton --tokens ...
TILE_CONFIGS: tuple[tuple[int, TileConfig], ...] = (
    (16, TileConfig(16, 64, 128, 1, 4, 3)),
    (96, TileConfig(16, 128, 128, 1, 4, 2)),
    (256, TileConfig(32, 256, 128, 16, 4, 2)),
    (768, TileConfig(64, 128, 64, 1, 4, 3)),
    (1 << 62, TileConfig(128, 256, 64, 16, 8, 4)),
)
ALIGN_CHUNK = 1024  # slots per iteration of the align kernel's loops


def tile_config(num_tokens: int) -> TileConfig:
    return next(cfg for bound, cfg in TILE_CONFIGS if num_tokens <= bound)


# A step whose tiles would give the GPU fewer than this many programs per SM takes narrower
# column tiles (spread_block_n): at one token, Mixtral-8x7B's down projection (2 experts, N
# 4096) is 2 x 64 = 128 programs of 64 columns on 132 SMs, each looping over K 14336 alone.
MIN_PROGRAMS_PER_SM = 2
MIN_BLOCK_N = 16


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def spread_block_n(
    cfg: TileConfig, n: int, num_slots: int, num_experts: int, device: torch.device
) -> TileConfig:
    """cfg with BLOCK_N halved (down to MIN_BLOCK_N) while the step's programs, at most
    min(E, S) experts hit times ceil(N / BLOCK_N) column tiles, would be fewer than
    MIN_PROGRAMS_PER_SM per SM (decode steps of few, large experts). By shapes and device
    only (a CUDA graph holds one config per shape); the CPU (the interpreter) keeps cfg."""
    if device.type != "cuda":
        return cfg
    want = MIN_PROGRAMS_PER_SM * _num_sms(device.index if device.index is not None else 0)
    return spread_block_n_for(cfg, n, min(num_experts, num_slots), want)


def spread_block_n_for(cfg: TileConfig, n: int, experts_hit: int, want: int) -> TileConfig:
    block_n = cfg.block_n
    while block_n > MIN_BLOCK_N and experts_hit * -(-n // block_n) < want:
        block_n //= 2
    return cfg._replace(block_n=block_n)


def _fit(cfg: TileConfig, n: int, k: int) -> TileConfig:
    """BLOCK_N and BLOCK_K no larger than the GEMM needs (tiny test shapes), at least 16."""

    def p2(v: int) -> int:
        return max(16, 1 << (v - 1).bit_length())

    return cfg._replace(block_n=min(cfg.block_n, p2(n)), block_k=min(cfg.block_k, p2(k)))


@functools.cache
def triton_unavailable_reason() -> str | None:
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception as exc:  # ImportError, or a broken install
        return f"triton is not importable: {exc!r}"
    return None


def supports(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> bool:
    """The Triton path can serve these tensors: fp16/bf16 on CUDA, triton importable."""
    return (
        x.is_cuda
        and x.dtype in TRITON_DTYPES
        and w13.dtype == x.dtype
        and w2.dtype == x.dtype
        and triton_unavailable_reason() is None
    )


def max_padded_rows(num_slots: int, num_experts: int, block_m: int) -> int:
    """Rows of the padded, expert-sorted batch at most: each expert that has a slot pads
    fewer than block_m rows, and at most min(E, S) experts have one."""
    return num_slots + min(num_experts, num_slots) * (block_m - 1)


def moe_align_blocks(
    topk_ids: torch.Tensor,  # [T, k] int
    num_experts: int,
    block_m: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """-> sorted_slots [max_blocks * block_m] int32 (slot ids by expert, S on padding rows,
    unwritten past the end), block_expert [max_blocks] int32 (-1 past the end)."""
    from pydaemon.layers.moe.triton_moe_kernels import moe_align_kernel

    ids = topk_ids.reshape(-1).to(torch.int32).contiguous()
    s = ids.numel()
    max_blocks = -(-max_padded_rows(s, num_experts, block_m) // block_m)
    sorted_slots = torch.empty(max_blocks * block_m, dtype=torch.int32, device=ids.device)
    block_expert = torch.empty(max_blocks, dtype=torch.int32, device=ids.device)
    moe_align_kernel[(num_experts + 1,)](
        ids,
        sorted_slots,
        block_expert,
        s,
        max_blocks,
        NUM_EXPERTS=num_experts,
        NUM_BINS=1 << num_experts.bit_length(),  # > num_experts
        BLOCK_M=block_m,
        CHUNK=ALIGN_CHUNK,
        num_warps=4,
    )
    return sorted_slots, block_expert


def moe_gemm(
    a: torch.Tensor,  # [rows, K], rows = tokens (a_row_div = top_k) or slots (1)
    w: torch.Tensor,  # [E, N, K]
    sorted_slots: torch.Tensor,
    block_expert: torch.Tensor,
    num_slots: int,
    a_row_div: int,
    cfg: TileConfig,
    weights: torch.Tensor | None = None,  # [S] float32: multiplied into each slot's row
) -> torch.Tensor:  # [S, N], a's dtype
    from pydaemon.layers.moe.triton_moe_kernels import INTERPRETED, moe_gemm_kernel

    if a.stride(-1) != 1:
        a = a.contiguous()
    if w.stride(-1) != 1:
        w = w.contiguous()
    n, k = w.shape[1], w.shape[2]
    if a.shape[1] != k:
        raise ValueError(f"moe_gemm: a has {a.shape[1]} columns, w's experts take {k}")
    cfg = _fit(cfg, n, k)
    out = torch.empty(num_slots, n, dtype=a.dtype, device=a.device)
    max_blocks = block_expert.numel()
    grid = (max_blocks * -(-n // cfg.block_n),)
    moe_gemm_kernel[grid](
        a,
        w,
        out,
        sorted_slots,
        block_expert,
        weights if weights is not None else out,  # not read without MUL_WEIGHT
        n,
        k,
        num_slots,
        max_blocks,
        a.stride(0),
        w.stride(0),
        w.stride(1),
        w.stride(2),
        out.stride(0),
        A_ROW_DIV=a_row_div,
        MUL_WEIGHT=weights is not None,
        DOT_F32=INTERPRETED,
        EVEN_K=k % cfg.block_k == 0,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        GROUP_M=cfg.group_m,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return out


def fused_experts_triton(
    x: torch.Tensor,  # [T, H]
    w13: torch.Tensor,  # [E, 2 * I, H]
    w2: torch.Tensor,  # [E, H, I]
    topk_weights: torch.Tensor,  # [T, k] float32
    topk_ids: torch.Tensor,  # [T, k] int32
    config: TileConfig | None = None,  # default: tile_config(T)
) -> torch.Tensor:  # [T, H], x's dtype
    t, k = topk_ids.shape
    if t == 0:
        return x.new_zeros(0, w2.shape[1])
    cfg = config or tile_config(t)
    num_experts = w13.shape[0]
    sorted_slots, block_expert = moe_align_blocks(topk_ids, num_experts, cfg.block_m)
    s = t * k
    cfg13, cfg2 = cfg, cfg
    if config is None:  # few experts hit: narrower column tiles, more programs
        cfg13 = spread_block_n(cfg, w13.shape[1], s, num_experts, x.device)
        cfg2 = spread_block_n(cfg, w2.shape[1], s, num_experts, x.device)
    h = moe_gemm(x, w13, sorted_slots, block_expert, s, k, cfg13)  # [S, 2 * I]
    weights = topk_weights.reshape(-1).to(torch.float32).contiguous()
    y = moe_gemm(_act(h), w2, sorted_slots, block_expert, s, 1, cfg2, weights)  # [S, H]
    return y.view(t, k, -1).sum(dim=1)
