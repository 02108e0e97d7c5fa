"""The experts of a MoE layer with 4-bit weights (int4: int4.py; MXFP4: mxfp4.py) on the
Triton W4A16 kernels (pydaemon/quantization/w4a16_kernels.py), for fp16 / bf16 on CUDA:

    h   = x[s // k] @ w13[e_s].T (+ b13[e_s])   per slot s = t * k + j     [S, 2I]
    a   = act_fn(h)                                                       [S, I]
    y   = weight[s] * (a[s] @ w2[e_s].T (+ b2[e_s]))                      [S, H]
    out = y.view(T, k, H).sum(1)      float32 sum in a fixed order, rounded once

Steps of at most ``MOE_GEMV_MAX_TOKENS`` tokens run each slot as a GEMV over its expert's
weights (grid: column tiles x slots; no sorting: a decode step reads each chosen expert once
per slot that chose it); larger steps sort the slots by expert, padded per expert to BLOCK_M
(triton_moe.moe_align_blocks), and run the tensor-core GEMM over them. Nothing is read back:
a CUDA graph captures both. Tiles: quantization/w4a16.py's, UNMEASURED (tune with
bench/bench_int4_gemm.py --moe).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from pydaemon.layers.moe.triton_moe import moe_align_blocks
from pydaemon.quantization import w4a16
from pydaemon.quantization.mxfp4 import BLOCK as MXFP4_BLOCK

# Tokens up to which the experts run as per-slot GEMVs. UNMEASURED: at one token of a top-8
# model the GEMM path pads each of 8 experts' single row to BLOCK_M 16.
MOE_GEMV_MAX_TOKENS = 4


class ExpertWeights(NamedTuple):
    """One projection of all experts (``w13`` or ``w2``), as the MoE methods hold it."""

    qweight: torch.Tensor  # int4: [E, N, K / 8] int32; MXFP4: [E, N, K / 2] uint8
    scales: torch.Tensor  # [E, N, K / G]
    qzeros: torch.Tensor | None  # [E, N, K / G] uint8
    perm: torch.Tensor | None  # [E, K] int32
    bias: torch.Tensor | None  # [E, N]
    kind: str  # "int4" | "mxfp4"

    def packed(self) -> w4a16.PackedWeights:
        if self.kind == "mxfp4":
            words = self.qweight.view(torch.int32)  # the bytes as little-endian words
            return w4a16.PackedWeights(words, self.scales, None, None, self.bias, 1, MXFP4_BLOCK)
        k = self.qweight.shape[2] * 8
        group = k // self.scales.shape[2]
        return w4a16.PackedWeights(
            self.qweight, self.scales, self.qzeros, self.perm, self.bias, 0, group
        )


def moe_rows_per_block(num_slots: int, num_experts: int) -> int:
    """The rows an expert's block holds on average (the slots spread over the experts they
    can reach), which picks the GEMM tile's BLOCK_M: a tile sized by the step's tokens would
    pad each expert's few rows to it (at 64 tokens of a top-8, 128-expert model: ~4 rows an
    expert, 16x the products in 64-row tiles)."""
    return -(-num_slots // min(num_experts, num_slots))


def supports(x: torch.Tensor) -> bool:
    return w4a16.supports(x)


def fused_experts(
    x: torch.Tensor,  # [T, H]
    w13: ExpertWeights,
    w2: ExpertWeights,
    topk_weights: torch.Tensor,  # [T, k] float32
    topk_ids: torch.Tensor,  # [T, k] int32
    act_fn: nn.Module,
) -> torch.Tensor:  # [T, H], x's dtype
    t, k = topk_ids.shape
    if t == 0:
        return x.new_zeros(0, x.shape[1])
    if x.stride(-1) != 1:
        x = x.contiguous()
    p13, p2 = w13.packed(), w2.packed()
    s = t * k
    weights = topk_weights.reshape(-1).to(torch.float32).contiguous()
    if t <= MOE_GEMV_MAX_TOKENS:
        ids = topk_ids.reshape(-1).to(torch.int32).contiguous()
        h = w4a16.launch_gemv(x, p13, s, expert_ids=ids, a_row_div=k)  # [S, 2I]
        a = act_fn(h)
        y = w4a16.launch_gemv(a, p2, s, expert_ids=ids, weights=weights)  # [S, H]
    else:
        rows = moe_rows_per_block(s, w13.qweight.shape[0])
        cfg = w4a16.gemm_config(rows, p13.n, p13.k, p13.group)
        cfg2 = w4a16.gemm_config(rows, p2.n, p2.k, p2.group)._replace(block_m=cfg.block_m)
        sorted_slots, block_expert = moe_align_blocks(topk_ids, w13.qweight.shape[0], cfg.block_m)
        h = w4a16.launch_gemm(x, p13, s, cfg, sorted_slots, block_expert, a_row_div=k)
        a = act_fn(h)
        y = w4a16.launch_gemm(a, p2, s, cfg2, sorted_slots, block_expert, weights=weights)
    return y.view(t, k, -1).sum(dim=1)
