"""The experts' computation of a MoE layer, given the routing (unquantized weights):

    rows   = x[sorted_token_ids]                       (tokens grouped by expert: align.py)
    h      = rows @ w13[e].T      per expert group      [T * k, 2 * I]  (gate and up at once)
    a      = silu(h[:, :I]) * h[:, I:]                  [T * k, I]
    y      = a @ w2[e].T          per expert group      [T * k, H]
    out[t] = sum_j weight[t, j] * y[inverse[t * k + j]]  (float32 sum, rounded once)

With expert biases and gpt-oss's clamped SwiGLU (``activation``: activation.py) the first line
adds ``w13_bias[e]`` to h, the activation replaces silu-and-mul, and ``w2_bias[e]`` joins each
slot's y before the weighted sum; such steps skip the decode kernels (they have neither).

The two per-group products are grouped GEMMs: ``torch._grouped_mm`` (CUTLASS on Hopper
tensor cores, no host sync: graph-capturable) for bfloat16 CUDA tensors; elsewhere (the CPU,
other dtypes and GPUs) one ``F.linear`` per expert that has rows, which reads the group
sizes on the host (while a CUDA graph is captured: every expert on all rows, masked). The
last line is one kernel on CUDA with pagedd's kernels (``ops.moe_combine``).

``MOE_BACKEND = "triton"`` runs the steps of at most ``MOE_TRITON_MAX_TOKENS`` tokens (fp16/bf16
on CUDA, triton importable) on Triton fused-MoE GEMMs instead (triton_moe.py: slots sorted and
padded per expert, one GEMM kernel for gate/up and one for down with the routing weight in its
epilogue). Off by default until measured on the GPU (issue 29).

A few tokens (``0 < T * k <= MOE_DECODE_MAX_SLOTS``, fp16/bf16 on CUDA) skip the grouping
and run two kernels (``ops.moe_decode_gate_up``: the first three lines per slot;
``ops.moe_decode_down_combine``: the last two), with the same roundings. At one token the
path above spends ~79 us a layer on the Qwen3-30B-A3B shape (H200) where its 75 MB of expert
weights take ~16 us to read. The choice depends on shapes, dtype and device only, never on a
device value: a captured CUDA graph holds one path for its shapes.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F

from pydaemon import ops
from pydaemon.layers.moe import triton_moe
from pydaemon.layers.moe.activation import SILU, MoeActivation
from pydaemon.layers.moe.align import moe_align

# Steps of at most this many (token, expert) slots take the two decode kernels. On the H200
# (Qwen3-30B-A3B shape, bf16, 2026-12-02) a bound of 64 made TPOT at batch 1 4.53 ms against
# 5.75 with the grouped GEMMs, but W1 16.69 s against 16.14 (its few-token steps lost): 8
# keeps one token of a top-8 model (or four of a top-2 one) on the kernels. The crossover in
# between is not measured.
MOE_DECODE_MAX_SLOTS = 8
_DECODE_DTYPES = (torch.float16, torch.bfloat16)
# The GEMMs of the steps the decode kernels do not take: "grouped" (above) or "triton"
# (triton_moe.py) for steps of at most MOE_TRITON_MAX_TOKENS tokens (the others: grouped).
# Triton: on the H200 (Qwen3-30B-A3B shape, bf16, dummy weights, same call, 2026-12-02) W1
# 13.13 s against 14.50 s grouped, TPOT at batch 64 19.16 ms against 25.42 ms
# (bench/throughput.py --moe-backend grouped|triton; bench/results/h200_2026-12-02e_session.md).
# Its tile table is not tuned yet (bench/bench_moe.py --triton-tile).
MOE_BACKENDS = ("grouped", "triton")
MOE_BACKEND = "triton"
MOE_TRITON_MAX_TOKENS = 1 << 30


@functools.cache
def _capability_major(device_index: int) -> int:
    return torch.cuda.get_device_capability(device_index)[0]


def _grouped_mm_device(device_index: int) -> bool:
    """torch._grouped_mm's CUTLASS kernels: Hopper (9.x) and datacenter Blackwell (10.x)."""
    return hasattr(torch, "_grouped_mm") and _capability_major(device_index) in (9, 10)


def use_grouped_mm(a: torch.Tensor) -> bool:
    return (
        a.is_cuda
        and a.dtype == torch.bfloat16
        and _grouped_mm_device(a.device.index if a.device.index is not None else 0)
    )


def grouped_mm(
    a: torch.Tensor,  # [M, K] rows grouped by expert
    w: torch.Tensor,  # [E, N, K]
    expert_offsets: torch.Tensor,  # [E] int32, cumulative ends of the groups
) -> torch.Tensor:  # [M, N]: rows of group e times w[e].T
    if use_grouped_mm(a):
        return torch._grouped_mm(a, w.transpose(1, 2), offs=expert_offsets)
    out = a.new_empty(a.shape[0], w.shape[1])
    return per_expert(out, expert_offsets, lambda rows, e: F.linear(a[rows], w[e]))


def _no_host_reads(t: torch.Tensor) -> bool:
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


def per_expert(
    out: torch.Tensor,  # [M, N]
    expert_offsets: torch.Tensor,  # [E] int32
    fn: Callable[[slice, int], torch.Tensor],  # (rows, expert) -> [rows, N]
) -> torch.Tensor:
    """out with the rows of each expert's group set to ``fn(rows, e)``: one call per expert
    that has rows (their bounds read on the host), or, while a CUDA graph is being captured
    (no host read allowed), every expert on all rows, each row keeping its own expert's
    result: graph-safe but E times the work (decode-sized steps only)."""
    if _no_host_reads(out):
        rows = torch.arange(out.shape[0], device=out.device, dtype=torch.int32)
        expert_of_row = torch.searchsorted(expert_offsets, rows, right=True)[:, None]
        for e in range(expert_offsets.shape[0]):
            out = torch.where(expert_of_row == e, fn(slice(None), e).to(out.dtype), out)
        return out
    start = 0
    for e, end in enumerate(expert_offsets.tolist()):
        if end > start:
            out[start:end] = fn(slice(start, end), e)
        start = end
    return out


def moe_combine(
    y: torch.Tensor,  # [T * k, H] expert outputs, rows grouped by expert
    inverse: torch.Tensor,  # [T * k] int32: row of slot t * k + j
    topk_weights: torch.Tensor,  # [T, k] float32
) -> torch.Tensor:  # [T, H], y's dtype
    if y.is_cuda and ops.moe_kernels_available():
        return ops.moe_combine(y, inverse, topk_weights)
    return moe_combine_native(y, inverse, topk_weights)


def moe_combine_native(
    y: torch.Tensor, inverse: torch.Tensor, topk_weights: torch.Tensor
) -> torch.Tensor:
    t, k = topk_weights.shape
    rows = y.index_select(0, inverse).view(t, k, -1).float()
    return (rows * topk_weights[..., None]).sum(dim=1).to(y.dtype)


def use_decode_kernels(x: torch.Tensor, w13: torch.Tensor, topk_ids: torch.Tensor) -> bool:
    """The two decode kernels serve this step: few slots, fp16/bf16 on CUDA, kernels built."""
    return (
        0 < topk_ids.numel() <= MOE_DECODE_MAX_SLOTS
        and x.is_cuda
        and x.dtype in _DECODE_DTYPES
        and w13.dtype == x.dtype
        and x.shape[1] <= ops.MOE_DECODE_MAX_HIDDEN
        and x.stride(-1) == 1
        and ops.moe_decode_kernels_available()
    )


def use_triton(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> bool:
    """The Triton fused-MoE GEMMs serve this step (by shapes, dtype and device only)."""
    return (
        MOE_BACKEND == "triton"
        and x.shape[0] <= MOE_TRITON_MAX_TOKENS
        and triton_moe.supports(x, w13, w2)
    )


def fused_experts(
    x: torch.Tensor,  # [T, H]
    w13: torch.Tensor,  # [E, 2 * I, H]
    w2: torch.Tensor,  # [E, H, I]
    topk_weights: torch.Tensor,  # [T, k] float32
    topk_ids: torch.Tensor,  # [T, k] int32
    activation: MoeActivation = SILU,
    w13_bias: torch.Tensor | None = None,  # [E, 2 * I]
    w2_bias: torch.Tensor | None = None,  # [E, H]
) -> torch.Tensor:  # [T, H]
    plain = activation.is_silu and w13_bias is None and w2_bias is None
    if plain and use_decode_kernels(x, w13, topk_ids):
        act = ops.moe_decode_gate_up(x, topk_ids, w13)  # [T * k, I]
        return ops.moe_decode_down_combine(act, topk_ids, topk_weights, w2)
    if use_triton(x, w13, w2):
        return triton_moe.fused_experts_triton(
            x, w13, w2, topk_weights, topk_ids, activation=activation, w13_bias=w13_bias,
            w2_bias=w2_bias,
        )  # fmt: skip
    sorted_token_ids, inverse, expert_offsets = moe_align(topk_ids, w13.shape[0])
    rows = x.index_select(0, sorted_token_ids)  # [T * k, H]
    h = grouped_mm(rows, w13, expert_offsets)  # [T * k, 2 * I]
    if w13_bias is not None or w2_bias is not None:
        # The expert of each row, from the group ends on the device (no host read).
        row_ids = torch.arange(rows.shape[0], device=x.device, dtype=torch.int32)
        expert_of_row = torch.searchsorted(expert_offsets, row_ids, right=True)
    if w13_bias is not None:
        h = h + w13_bias[expert_of_row]
    y = grouped_mm(activation(h), w2, expert_offsets)  # [T * k, H]
    if w2_bias is not None:
        y = y + w2_bias[expert_of_row]
    return moe_combine(y, inverse, topk_weights)
