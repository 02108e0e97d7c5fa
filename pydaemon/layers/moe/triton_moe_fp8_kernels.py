"""The Triton GEMM kernel of the FP8 fused-MoE expert path (triton_moe_fp8.py launches it; this
module imports triton, so only that module imports it, lazily). The slots come sorted and
padded per expert by triton_moe_kernels.moe_align_kernel, as for the bf16 kernel.

``moe_gemm_fp8_kernel``: one program per (BLOCK_M rows, BLOCK_N columns) tile of one expert:

    c[s, n] = [weight[s] *] a_scale[r] * sum_k a[r, k] * wq[e, n, k] * w_scale(e, n, k)

with r = s // A_ROW_DIV (the slot's token for the gate/up GEMM, the slot itself for down),
e the block's expert, and the weights FP8 e4m3 with either

- per-output-channel scales (``SCALE_BN == 0``): ``w_scale`` [E, N], applied once in the
  epilogue;
- block scales (``SCALE_BN, SCALE_BK > 0``, HF FP8 checkpoints' 128 x 128): ``w_scale``
  [E, ceil(N / SCALE_BN), ceil(K / SCALE_BK)]; each BLOCK_K step lies inside one block of K
  (BLOCK_K divides SCALE_BK), its partial product is scaled per column before it is added.

Two kinds of activations:

- ``A_FP8`` (w8a8): ``a`` float8_e4m3fn quantized per row with ``a_scale`` [rows] float32;
  the products are FP8 x FP8 tensor-core dots (wgmma from 64 rows a tile on Hopper) and
  a_scale is applied in the epilogue (it factors out of every block of K);
- otherwise (w8a16): ``a`` fp16/bf16 as it is, each weight tile converted to a's dtype in
  registers (exact: every e4m3 value is a bf16 / fp16 value) and dotted on the bf16 / fp16
  tensor cores; no activation quantization (decode-sized steps, where the weights' bytes
  are the cost and the quantization kernels would be two more launches a layer).

Padding rows (slot S) are read as zeros and never stored; columns past N read row n % N and
are never stored; programs past the last expert's block return at once (the grid is sized by
the most blocks the padding can take, so a captured CUDA graph replays with any routing).

``DOT_F32`` converts both operands to float32 before ``tl.dot`` (the interpreter's dot is
wrong on bf16: triton_moe_kernels.py), as the bf16 kernel does.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit(do_not_specialize=["num_slots", "max_blocks"])
def moe_gemm_fp8_kernel(
    a_ptr,  # [rows, K]: fp8 (A_FP8) or fp16/bf16
    a_scale_ptr,  # [rows] float32 (read only with A_FP8)
    w_ptr,  # [E, N, K] float8_e4m3fn
    w_scale_ptr,  # [E, N] or [E, ceil(N / SCALE_BN), ceil(K / SCALE_BK)] float32
    c_ptr,  # [S, N] out, one row per slot
    sorted_slots_ptr,  # [max_blocks * BLOCK_M] int32
    block_expert_ptr,  # [max_blocks] int32
    weight_ptr,  # [S] float32 routing weights (read only with MUL_WEIGHT)
    N,
    K,
    num_slots,
    max_blocks,
    stride_am,
    stride_we,
    stride_wn,
    stride_wk,
    stride_cm,
    stride_se,
    stride_sn,
    stride_sk,
    A_ROW_DIV: tl.constexpr,
    MUL_WEIGHT: tl.constexpr,
    A_FP8: tl.constexpr,
    SCALE_BN: tl.constexpr,  # 0: per-channel scales
    SCALE_BK: tl.constexpr,
    DOT_F32: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    # Programs in groups of GROUP_M row blocks, column block by column block (L2 reuse of w).
    pid = tl.program_id(0)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    in_group = GROUP_M * num_pid_n
    first_m = (pid // in_group) * GROUP_M
    group_m = min(max_blocks - first_m, GROUP_M)
    pid_m = first_m + (pid % in_group) % group_m
    pid_n = (pid % in_group) // group_m

    expert = tl.load(block_expert_ptr + pid_m)
    if expert < 0:
        return
    slots = tl.load(sorted_slots_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = slots < num_slots
    a_rows = (slots // A_ROW_DIV).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    safe_n = offs_n % N  # columns past N read row n % N, never stored
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + a_rows[:, None] * stride_am + offs_k[None, :]
    expert64 = expert.to(tl.int64)
    w_ptrs = (
        w_ptr + expert64 * stride_we + safe_n[None, :] * stride_wn + offs_k[:, None] * stride_wk
    )
    if SCALE_BN > 0:
        s_ptrs = w_scale_ptr + expert64 * stride_se + (safe_n // SCALE_BN) * stride_sn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=valid[:, None], other=0.0)
            w = tl.load(w_ptrs)
        else:
            in_k = offs_k + k0 < K
            a = tl.load(a_ptrs, mask=valid[:, None] & in_k[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=in_k[:, None], other=0.0)
        if not A_FP8:
            w = w.to(a.dtype)  # w8a16: exact
        if DOT_F32:
            a = a.to(tl.float32)
            w = w.to(tl.float32)
        if SCALE_BN > 0:
            scale = tl.load(s_ptrs + (k0 // SCALE_BK) * stride_sk)  # [BLOCK_N]
            acc += tl.dot(a, w) * scale[None, :]
        else:
            acc = tl.dot(a, w, acc)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K * stride_wk
    if SCALE_BN == 0:
        acc = acc * tl.load(w_scale_ptr + expert64 * stride_se + safe_n * stride_sn)[None, :]
    if A_FP8:
        acc = acc * tl.load(a_scale_ptr + a_rows, mask=valid, other=0.0)[:, None]
    if MUL_WEIGHT:
        acc = acc * tl.load(weight_ptr + slots, mask=valid, other=0.0)[:, None]
    c_ptrs = c_ptr + slots.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=valid[:, None] & (offs_n[None, :] < N))
