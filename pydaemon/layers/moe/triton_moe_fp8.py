"""The FP8 experts of a MoE layer as Triton fused-MoE GEMMs (triton_moe.py's path with FP8
weights: triton_moe_fp8_kernels.py), for every step size on CUDA:

    sorted, blocks = align(topk_ids)            as triton_moe.py (the same kernel)
    h   = x[s // k] @ dq(w13[e]).T               [S, 2 * I]
    a   = silu(h[:, :I]) * h[:, I:]              [S, I]
    y   = weight[s] * (a[s] @ dq(w2[e]).T)       [S, H]
    out = y.view(T, k, H).sum(1)

with dq(w) the FP8 weights times their scales: per output channel ([E, N]) or per block of
the checkpoint ([E, ceil(N / bn), ceil(K / bk)], HF FP8's 128 x 128), both applied inside the
kernel (nothing is dequantized in memory). Two ways to run the products:

- **w8a8** (steps of more than ``W8A16_MAX_TOKENS`` tokens, tiles of 64 rows and more): x
  quantized per token (one kernel), the SiLU-and-mul output quantized per slot in the same
  kernel as the product (``SiluAndMul(fp8_out=True)``), FP8 x FP8 tensor-core dots, scales
  in the epilogue: the dense FP8 layers' scheme (pydaemon/quantization/fp8.py), at twice
  bf16's tensor-core rate;
- **w8a16** (decode-sized steps): activations stay bf16 / fp16 and each FP8 weight tile is
  widened in registers: no quantization kernels, the same bytes of weights read, and closer
  to the unquantized model (only the weights are rounded).

Why this path exists: FP8 experts used to take the grouped path for every step size (per-token
quantization, two gathers, ``torch._scaled_grouped_mm`` twice, SiLU-and-mul, a combine: 8
launches a layer where the Triton path takes 5, and nothing shaped for decode where bf16 has
its decode kernels), so FP8 MoE ran slower than bf16 although its weights are half the bytes
(Qwen3-30B-A3B shape on the H200, 2026-12-04: W1 15.31 s against 13.28 s, TPOT 5.77 / 18.81
ms at batch 1 / 64 against 4.49 / 19.23 ms).

Tiles: ``FP8_TILE_CONFIGS`` by the number of tokens, then ``triton_moe.spread_block_n`` for
steps whose tiles would leave SMs idle (few experts hit, e.g. Mixtral at one token). The
values are UNMEASURED starting points (the bf16 table's shapes with BLOCK_K 128, the K of an
FP8 wgmma's 4 steps and of HF's scale blocks; vLLM's H200 fp8_w8a8 table for Mixtral's
experts uses BLOCK_M 64-128 and BLOCK_K 128-256 the same way): tune with bench/bench_moe.py
--quantization fp8 --triton-tile. With block scales BLOCK_K is cut to divide the scale
block's K.
"""

from __future__ import annotations

import torch

from pydaemon.layers.activation import SiluAndMul
from pydaemon.layers.moe import triton_moe
from pydaemon.layers.moe.triton_moe import TileConfig
from pydaemon.quantization.fp8 import FP8_DTYPE, quantize_per_token

_act = SiluAndMul()

# Steps of at most this many tokens run w8a16 (no activation quantization); larger ones w8a8.
# The tiles of these steps have BLOCK_M 16, under a warp group's 64 rows: Triton then runs FP8
# x FP8 dots as mma.sync on fp16 operands anyway (m16n8k16.f16, sm_90 PTX from Triton 3.9;
# tests/test_moe_triton_fp8.py), so w8a8 would only add the quantization launches. From BLOCK_M
# 64 the w8a8 dots are wgmma e4m3 (m64nNk32), twice bf16's rate. Speed UNMEASURED: the A/B is
# bench/bench_moe.py --quantization fp8 --fp8-w8a16-max-tokens 0|96 (bench/issue41_suite.sh).
W8A16_MAX_TOKENS = 96

# (at most this many tokens, config), first match. UNMEASURED (see the module docstring).
FP8_TILE_CONFIGS: tuple[tuple[int, TileConfig], ...] = (
    (16, TileConfig(16, 64, 256, 1, 4, 4)),
    (96, TileConfig(16, 128, 128, 1, 4, 3)),
    (256, TileConfig(64, 128, 128, 1, 4, 3)),
    (768, TileConfig(64, 128, 128, 16, 4, 3)),
    (1 << 62, TileConfig(128, 256, 128, 16, 8, 3)),
)


def fp8_tile_config(num_tokens: int) -> TileConfig:
    return next(cfg for bound, cfg in FP8_TILE_CONFIGS if num_tokens <= bound)


def supports(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> bool:
    """The FP8 Triton path can serve these tensors: fp16/bf16 activations and FP8 weights on
    CUDA, triton importable."""
    return (
        x.is_cuda
        and x.dtype in triton_moe.TRITON_DTYPES
        and w13.dtype == FP8_DTYPE
        and w2.dtype == FP8_DTYPE
        and triton_moe.triton_unavailable_reason() is None
    )


def _fit_fp8(
    cfg: TileConfig, n: int, k: int, block_shape: tuple[int, int] | None, a_fp8: bool
) -> TileConfig:
    """triton_moe._fit, then BLOCK_K at least 32 for FP8 x FP8 dots (an 8-bit mma's K) and,
    with block scales, dividing the scale block's K (each K step inside one block)."""
    cfg = triton_moe._fit(cfg, n, k)
    block_k = max(cfg.block_k, 32) if a_fp8 else cfg.block_k
    if block_shape is not None:
        bk = block_shape[1]
        while block_k > 16 and bk % block_k:
            block_k //= 2
        if bk % block_k or (a_fp8 and block_k < 32):
            raise ValueError(
                f"FP8 block scales of K block {bk}: need a multiple of 16 (of 32 with FP8 "
                "activations)"
            )
    return cfg._replace(block_k=block_k)


def moe_gemm_fp8(
    a: torch.Tensor,  # [rows, K] fp8 (with a_scale) or fp16/bf16
    a_scale: torch.Tensor | None,  # [rows] or [rows, 1] float32: a's per-row scales
    w: torch.Tensor,  # [E, N, K] float8_e4m3fn
    w_scale: torch.Tensor,  # [E, N] or [E, ceil(N / bn), ceil(K / bk)] float32
    block_shape: tuple[int, int] | None,  # (bn, bk) of block scales; None: per channel
    sorted_slots: torch.Tensor,
    block_expert: torch.Tensor,
    num_slots: int,
    a_row_div: int,
    cfg: TileConfig,
    out_dtype: torch.dtype,
    weights: torch.Tensor | None = None,  # [S] float32: multiplied into each slot's row
) -> torch.Tensor:  # [S, N], out_dtype
    from pydaemon.layers.moe.triton_moe_fp8_kernels import moe_gemm_fp8_kernel
    from pydaemon.layers.moe.triton_moe_kernels import INTERPRETED

    if a.stride(-1) != 1:
        a = a.contiguous()
    if w.stride(-1) != 1:
        w = w.contiguous()
    n, k = w.shape[1], w.shape[2]
    if a.shape[1] != k:
        raise ValueError(f"moe_gemm_fp8: a has {a.shape[1]} columns, w's experts take {k}")
    a_fp8 = a.dtype == FP8_DTYPE
    if a_fp8 and a_scale is None:
        raise ValueError("moe_gemm_fp8: FP8 activations need their per-row scales")
    if block_shape is None:
        scale_bn = scale_bk = 0
        if w_scale.shape != (w.shape[0], n):
            raise ValueError(f"per-channel scales {list(w_scale.shape)}, expected [E, {n}]")
        stride_sk = 0
    else:
        scale_bn, scale_bk = block_shape
        want = (w.shape[0], -(-n // scale_bn), -(-k // scale_bk))
        if tuple(w_scale.shape) != want:
            raise ValueError(f"block scales {list(w_scale.shape)}, expected {list(want)}")
        stride_sk = w_scale.stride(2)
    cfg = _fit_fp8(cfg, n, k, block_shape, a_fp8)
    out = torch.empty(num_slots, n, dtype=out_dtype, device=a.device)
    max_blocks = block_expert.numel()
    grid = (max_blocks * -(-n // cfg.block_n),)
    a_scale_arg = a_scale.reshape(-1) if a_scale is not None else out
    moe_gemm_fp8_kernel[grid](
        a,
        a_scale_arg,  # not read without A_FP8
        w,
        w_scale,
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
        w_scale.stride(0),
        w_scale.stride(1),
        stride_sk,
        A_ROW_DIV=a_row_div,
        MUL_WEIGHT=weights is not None,
        A_FP8=a_fp8,
        SCALE_BN=scale_bn,
        SCALE_BK=scale_bk,
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


def fused_experts_triton_fp8(
    x: torch.Tensor,  # [T, H] fp16/bf16
    w13: torch.Tensor,  # [E, 2 * I, H] float8_e4m3fn
    w13_scale: torch.Tensor,  # [E, 2 * I] or [E, ceil(2 * I / bn), ceil(H / bk)] float32
    w2: torch.Tensor,  # [E, H, I] float8_e4m3fn
    w2_scale: torch.Tensor,  # [E, H] or [E, ceil(H / bn), ceil(I / bk)] float32
    topk_weights: torch.Tensor,  # [T, k] float32
    topk_ids: torch.Tensor,  # [T, k] int32
    block_shape: tuple[int, int] | None = None,
    w8a8: bool | None = None,  # default: T > W8A16_MAX_TOKENS
    config: TileConfig | None = None,  # default: fp8_tile_config(T), spread over the SMs
) -> torch.Tensor:  # [T, H], x's dtype
    t, k = topk_ids.shape
    if t == 0:
        return x.new_zeros(0, w2.shape[1])
    if w8a8 is None:
        w8a8 = t > W8A16_MAX_TOKENS
    num_experts = w13.shape[0]
    cfg = config or fp8_tile_config(t)
    sorted_slots, block_expert = triton_moe.moe_align_blocks(topk_ids, num_experts, cfg.block_m)
    s = t * k
    weights = topk_weights.reshape(-1).to(torch.float32).contiguous()
    cfg13, cfg2 = cfg, cfg
    if config is None:
        cfg13 = triton_moe.spread_block_n(cfg, w13.shape[1], s, num_experts, x.device)
        cfg2 = triton_moe.spread_block_n(cfg, w2.shape[1], s, num_experts, x.device)
    if w8a8:
        xq, x_scale = quantize_per_token(x)  # [T, H] fp8, [T, 1]
        h = moe_gemm_fp8(xq, x_scale, w13, w13_scale, block_shape, sorted_slots, block_expert,
                         s, k, cfg13, x.dtype)  # fmt: skip
        act = _act(h, fp8_out=True)  # [S, I] fp8 quantized per slot
        y = moe_gemm_fp8(act.xq, act.scale, w2, w2_scale, block_shape, sorted_slots,
                         block_expert, s, 1, cfg2, x.dtype, weights)  # fmt: skip
    else:
        h = moe_gemm_fp8(x, None, w13, w13_scale, block_shape, sorted_slots, block_expert,
                         s, k, cfg13, x.dtype)  # fmt: skip
        y = moe_gemm_fp8(_act(h), None, w2, w2_scale, block_shape, sorted_slots, block_expert,
                         s, 1, cfg2, x.dtype, weights)  # fmt: skip
    return y.view(t, k, -1).sum(dim=1)
