"""Mixture-of-experts kernels on the GPU (cpp/cuda/moe_kernels.cu): top-k routing, grouping
slots by expert, weighted combine; for a few tokens the whole expert computation in two
kernels (cpp/cuda/moe_decode_kernels.cu; with FP8 weights cpp/cuda/moe_decode_fp8_kernels.cu). The torch code they replace is in
pydaemon/layers/moe/."""

from __future__ import annotations

import torch

from pydaemon.ops._core_ext import arg, core, is_available, stream_handle


def moe_kernels_available() -> bool:
    """The GPU kernels run here and ``_core`` was built with the MoE kernels."""
    return is_available() and hasattr(core(), "moe_align")


def moe_decode_kernels_available() -> bool:
    """The GPU kernels run here and ``_core`` was built with the MoE decode kernels."""
    return is_available() and hasattr(core(), "moe_decode_gate_up")


def moe_decode_fp8_kernels_available() -> bool:
    """The GPU kernels run here and ``_core`` was built with the FP8-weight decode kernels."""
    return is_available() and hasattr(core(), "moe_decode_gate_up_fp8")


# Largest hidden size of moe_decode_gate_up, which stages x[t] in shared memory (C++:
# kMoeDecodeMaxHidden in cpp/cuda/moe_kernels.h).
MOE_DECODE_MAX_HIDDEN = 16384


def topk_route(
    logits: torch.Tensor, top_k: int, softmax: bool, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] fp16/bf16/fp32, last dim contiguous -> (weights [T, k] float32, ids
    [T, k] int32), experts by descending score, ties to the lower id."""
    t = logits.shape[0]
    weights = torch.empty(t, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(t, top_k, dtype=torch.int32, device=logits.device)
    core().topk_route(
        arg(weights), arg(ids), arg(logits), softmax, renormalize, stream_handle(logits.device)
    )
    return weights, ids


def moe_align(
    topk_ids: torch.Tensor, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """topk_ids [T, k] int32 contiguous -> (sorted_token_ids [T * k], inverse [T * k],
    expert_offsets [E]), all int32 (pydaemon/layers/moe/align.py)."""
    n = topk_ids.numel()
    device = topk_ids.device
    sorted_token_ids = torch.empty(n, dtype=torch.int32, device=device)
    inverse = torch.empty(n, dtype=torch.int32, device=device)
    offsets = torch.empty(num_experts, dtype=torch.int32, device=device)
    core().moe_align(
        arg(sorted_token_ids), arg(inverse), arg(offsets), arg(topk_ids), stream_handle(device)
    )
    return sorted_token_ids, inverse, offsets


def moe_combine(
    expert_out: torch.Tensor, inverse: torch.Tensor, topk_weights: torch.Tensor
) -> torch.Tensor:
    """expert_out [T * k, H], inverse [T * k] int32, topk_weights [T, k] float32 -> [T, H]."""
    out = torch.empty(
        topk_weights.shape[0], expert_out.shape[1], dtype=expert_out.dtype, device=expert_out.device
    )
    core().moe_combine(
        arg(out), arg(expert_out), arg(inverse), arg(topk_weights), stream_handle(out.device)
    )
    return out


def moe_decode_gate_up(x: torch.Tensor, topk_ids: torch.Tensor, w13: torch.Tensor) -> torch.Tensor:
    """The experts' gate/up projection and SiLU-and-mul for a few tokens, one kernel.

    act[t * k + j, c] = silu(g) * u with g = x[t] . w13[e, c], u = x[t] . w13[e, I + c],
    e = topk_ids[t, j]: float32 sums, g and u rounded to the dtype, then silu_and_mul's
    roundings (the unfused grouped GEMM + ``silu_and_mul`` up to summation order). An id
    outside [0, E) gives a zero row.

    x:         [T, H] fp16/bf16, last dim contiguous, H <= MOE_DECODE_MAX_HIDDEN
    topk_ids:  [T, k] int32, contiguous
    w13:       [E, 2 * I, H], x's dtype, contiguous (each expert's gate rows, then up rows)
    returns    act [T * k, I], x's dtype
    """
    act = torch.empty(topk_ids.numel(), w13.shape[1] // 2, dtype=x.dtype, device=x.device)
    core().moe_decode_gate_up(arg(act), arg(x), arg(topk_ids), arg(w13), stream_handle(x.device))
    return act


def moe_decode_down_combine(
    act: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w2: torch.Tensor
) -> torch.Tensor:
    """The experts' down projection and the weighted sum over each token's experts, one kernel.

    out[t, h] = sum_j topk_weights[t, j] * y_j with y_j = act[t * k + j] . w2[e_j, h] in
    float32, rounded to the dtype (as the grouped GEMM stores it); the sum over j in order in
    float32, rounded once (``moe_combine``). An id outside [0, E) adds nothing.

    act:           [T * k, I] fp16/bf16, contiguous (``moe_decode_gate_up``'s)
    topk_ids:      [T, k] int32, contiguous
    topk_weights:  [T, k] float32, contiguous
    w2:            [E, H, I], act's dtype, contiguous
    returns        out [T, H], act's dtype
    """
    out = torch.empty(topk_ids.shape[0], w2.shape[1], dtype=act.dtype, device=act.device)
    core().moe_decode_down_combine(
        arg(out), arg(act), arg(topk_ids), arg(topk_weights), arg(w2), stream_handle(act.device)
    )
    return out


def _fp8_bytes(w: torch.Tensor, name: str) -> torch.Tensor:
    if w.dtype != torch.float8_e4m3fn:
        raise TypeError(f"{name} must be float8_e4m3fn, got {w.dtype}")
    return w.view(torch.uint8)


def _blocks(block_shape: tuple[int, int] | None) -> tuple[int, int]:
    return (0, 0) if block_shape is None else block_shape


def moe_decode_gate_up_fp8(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    w13: torch.Tensor,
    w13_scale: torch.Tensor,
    block_shape: tuple[int, int] | None = None,
) -> torch.Tensor:
    """moe_decode_gate_up with FP8 expert weights (w8a16: x stays fp16 / bf16; the weights are
    widened in registers and their scales applied to the float32 sums).

    x:          [T, H] fp16/bf16, rows 16-byte aligned, H a multiple of 16, <= MOE_DECODE_MAX_HIDDEN
    topk_ids:   [T, k] int32, contiguous
    w13:        [E, 2 * I, H] float8_e4m3fn, contiguous, I a multiple of 16
    w13_scale:  [E, 2 * I] float32 (block_shape None), or [E, ceil(2 * I / bn), ceil(H / bk)]
                for block_shape (bn, bk), bk a multiple of 16
    returns     act [T * k, I], x's dtype
    """
    act = torch.empty(topk_ids.numel(), w13.shape[1] // 2, dtype=x.dtype, device=x.device)
    bn, bk = _blocks(block_shape)
    core().moe_decode_gate_up_fp8(
        arg(act), arg(x), arg(topk_ids), arg(_fp8_bytes(w13, "w13")), arg(w13_scale), bn, bk,
        stream_handle(x.device),
    )  # fmt: skip
    return act


def moe_decode_down_combine_fp8(
    act: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w2: torch.Tensor,
    w2_scale: torch.Tensor,
    block_shape: tuple[int, int] | None = None,
) -> torch.Tensor:
    """moe_decode_down_combine with FP8 expert weights.

    act:           [T * k, I] fp16/bf16, contiguous (``moe_decode_gate_up_fp8``'s)
    topk_ids:      [T, k] int32, contiguous
    topk_weights:  [T, k] float32, contiguous
    w2:            [E, H, I] float8_e4m3fn, contiguous
    w2_scale:      [E, H] float32, or [E, ceil(H / bn), ceil(I / bk)] for block_shape (bn, bk)
    returns        out [T, H], act's dtype
    """
    out = torch.empty(topk_ids.shape[0], w2.shape[1], dtype=act.dtype, device=act.device)
    bn, bk = _blocks(block_shape)
    core().moe_decode_down_combine_fp8(
        arg(out), arg(act), arg(topk_ids), arg(topk_weights), arg(_fp8_bytes(w2, "w2")),
        arg(w2_scale), bn, bk, stream_handle(act.device),
    )  # fmt: skip
    return out
