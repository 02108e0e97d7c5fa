"""Triton kernels of the mixed-input (4-bit weights, fp16 / bf16 activations) GEMMs: dense
linear layers (quantization/w4a16.py launches them) and MoE experts (layers/moe/w4a16_moe.py).
This module imports triton: only those two import it, lazily.

Weights: ``w`` [E, N, K / 8] int32 (E = 1 for a dense layer): nibble j of word i of row n is
the code of input column 8i + j (quantization/int4.py; MXFP4 bytes viewed as words have the
same order). ``FORMAT`` 0 (int4): w = (code - zero) * scale per group of ``GROUP`` columns,
scales [E, N, K / GROUP] fp16 / bf16, zeros [E, N, K / GROUP] uint8 (8 without HAS_ZP);
``FORMAT`` 1 (MXFP4): w = e2m1(code) * 2^(scale - 127), scales [E, N, K / 32] uint8.
``HAS_PERM``: the activations are read through perm [E, K] (act-order: column p of the
weights is input column perm[p]).

``w4a16_gemv_kernel`` (decode: one row of a per program, no tensor cores): a program computes
BLOCK_N outputs of one row, streaming BLOCK_N weight rows of BLOCK_K columns per iteration as
[BLOCK_N, NG, PG] words (NG groups of PG words in the tile). The int4 codes become floats
without an int-to-float conversion: ``(word & (0xF << 4j)) | 0x4B000000`` read as float32 is
2^23 + code * 2^4j (j < 4; the upper four nibbles come from ``word >> 16``), so one AND-OR and
one subtraction give code * 2^4j exactly, and the activation is pre-scaled by 2^-4j (once a
tile, shared by the BLOCK_N rows). The group's scale and zero point are applied per word
(8 columns) rather than per column: sum_k (code_k - z) s x_k = s (sum_k code_k x_k - z sum_k
x_k), and the partial sums are reduced across threads once, after the loop.
Rows: a dense layer's tokens, or (MOE) the (token, expert) slots, each with its expert's
weights (``expert_ids``) and its token's activation row (slot // A_ROW_DIV).

``w4a16_gemm_kernel`` (prefill / batched decode: tensor cores): BLOCK_M x BLOCK_N tiles,
weights dequantized to the activation dtype in registers (a K tile lies in one group:
BLOCK_K <= GROUP) and multiplied by ``tl.dot``. Dense rows are the tokens; MoE rows are the
slots sorted and padded per expert (layers/moe/triton_moe.py's align), as its fused-MoE GEMM.

Epilogues: ``HAS_BIAS`` adds a per-expert bias [E, N]; ``MUL_WEIGHT`` multiplies each row by
its routing weight [S] (the down projection of the experts). ``DOT_F32``: operands converted
to float32 before tl.dot, for Triton's interpreter (the CPU tests), whose bf16 dot is broken.
Nothing here reads a device value on the host or allocates: a CUDA graph captures them.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

try:
    INTERPRETED = bool(triton.knobs.runtime.interpret)
except AttributeError:  # triton < 3.4 has no knobs
    INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"

MAGIC = tl.constexpr(0x4B000000)  # float32 2^23: its mantissa holds small integers exactly


@triton.jit
def _e2m1(code):
    """int32 codes 0..15 -> float32 e2m1 values (0, 0.5, 1, 1.5, 2, 3, 4, 6, signed)."""
    mag = code & 7
    # Normal codes (mag >= 2): exponent e = mag >> 1 (bias 1), mantissa mag & 1, written
    # into float32's fields with bias 127; mag 1 is the subnormal 0.5, mag 0 zero.
    bits = tl.where(mag >= 2, (mag << 22) + (126 << 23), mag * (126 << 23))
    bits = bits | ((code & 8) << 28)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _e8m0(s):
    """uint8 e8m0 exponents -> float32 2^(s - 127) (s = 0: 0 instead of 2^-127)."""
    return (s.to(tl.int32) << 23).to(tl.float32, bitcast=True)


@triton.jit(do_not_specialize=["num_rows"])
def w4a16_gemv_kernel(
    a_ptr,  # [rows_a, K] activations
    w_ptr,  # [E, N, K / 8] int32
    scale_ptr,  # [E, N, K / GROUP]
    zero_ptr,  # [E, N, K / GROUP] uint8 (read with HAS_ZP)
    perm_ptr,  # [E, K] int32 (read with HAS_PERM)
    bias_ptr,  # [E, N] (read with HAS_BIAS)
    expert_ids_ptr,  # [rows] int32: each row's expert (read with MOE)
    weight_ptr,  # [rows] float32 routing weights (read with MUL_WEIGHT)
    c_ptr,  # [rows, N] out
    num_rows,
    N: tl.constexpr,
    K: tl.constexpr,
    stride_am,
    stride_cm,
    FORMAT: tl.constexpr,
    GROUP: tl.constexpr,
    HAS_ZP: tl.constexpr,
    HAS_PERM: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    MUL_WEIGHT: tl.constexpr,
    MOE: tl.constexpr,
    A_ROW_DIV: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_n = tl.program_id(0)
    row = tl.program_id(1)
    if MOE:
        expert = tl.load(expert_ids_ptr + row).to(tl.int64)
    else:
        expert = 0
    a_row = row // A_ROW_DIV
    NG: tl.constexpr = BLOCK_K // GROUP if GROUP < BLOCK_K else 1  # groups in a K tile
    PG: tl.constexpr = BLOCK_K // 8 // NG  # words of one group in a K tile
    KW: tl.constexpr = K // 8  # words per weight row
    NUM_GROUPS: tl.constexpr = K // GROUP

    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows_n = offs_n % N  # rows past N read row n % N, never stored
    offs_g = tl.arange(0, NG)
    offs_p = tl.arange(0, PG)
    word = offs_g[:, None] * PG + offs_p[None, :]  # [NG, PG] word index within the tile
    w_rows = w_ptr + expert * N * KW + rows_n.to(tl.int64) * KW  # [BLOCK_N]
    s_rows = expert * N * NUM_GROUPS + rows_n.to(tl.int64) * NUM_GROUPS  # [BLOCK_N]
    # Accumulated per (row, group, word) and reduced once at the end: no cross-thread
    # reduction (shared memory, barriers) inside the loop.
    acc = tl.zeros((BLOCK_N, NG, PG), dtype=tl.float32)
    # The next tile's words are loaded before this tile is computed (a register prefetch:
    # Triton pipelines only the loads that feed tl.dot), doubling the bytes in flight.
    in_next = word < KW
    q_next = tl.load(w_rows[:, None, None] + word[None, :, :], mask=in_next[None, :, :], other=0)
    for k0 in range(0, K, BLOCK_K):
        w_idx = k0 // 8 + word  # [NG, PG]
        in_k = w_idx < KW
        q = q_next
        in_next = w_idx + BLOCK_K // 8 < KW
        q_next = tl.load(w_rows[:, None, None] + (w_idx + BLOCK_K // 8)[None, :, :],
                         mask=in_next[None, :, :], other=0)  # fmt: skip
        group = (k0 + offs_g * PG * 8) // GROUP  # [NG]
        in_g = (group < NUM_GROUPS)[None, :, None]
        s_idx = s_rows[:, None, None] + group[None, :, None]  # [BLOCK_N, NG, 1]
        scale = tl.load(scale_ptr + s_idx, mask=in_g, other=0)
        part = tl.zeros((BLOCK_N, NG, PG), dtype=tl.float32)
        x_sum = tl.zeros((NG, PG), dtype=tl.float32)
        for j in tl.static_range(8):
            col = k0 + word * 8 + j  # [NG, PG] column (in the weights' order)
            if HAS_PERM:
                col = tl.load(perm_ptr + expert * K + col, mask=in_k, other=0)
            x = tl.load(a_ptr + a_row * stride_am + col, mask=in_k, other=0.0).to(tl.float32)
            if FORMAT == 0:
                x_sum += x
                if j < 4:
                    bits = (q & (0xF << (4 * j))) | MAGIC
                else:
                    bits = ((q >> 16) & (0xF << (4 * (j - 4)))) | MAGIC
                code = bits.to(tl.float32, bitcast=True) - 8388608.0  # code * 2^(4 (j % 4))
                part += code * (x * (1.0 / (1 << (4 * (j % 4)))))[None, :, :]
            else:
                value = _e2m1((q >> (4 * j)) & 0xF)
                part += value * x[None, :, :]
        if FORMAT == 0:
            if HAS_ZP:
                zero = tl.load(zero_ptr + s_idx, mask=in_g, other=0).to(tl.float32)
            else:
                zero = 8.0
            acc += scale.to(tl.float32) * (part - zero * x_sum[None, :, :])
        else:
            acc += _e8m0(scale) * part
    out = tl.sum(tl.sum(acc, axis=2), axis=1)  # [BLOCK_N]
    if HAS_BIAS:
        out += tl.load(bias_ptr + expert * N + rows_n).to(tl.float32)
    if MUL_WEIGHT:
        out = out * tl.load(weight_ptr + row)
    tl.store(c_ptr + row * stride_cm + offs_n, out.to(c_ptr.dtype.element_ty), mask=offs_n < N)


@triton.jit(do_not_specialize=["num_rows", "max_blocks"])
def w4a16_gemm_kernel(
    a_ptr,  # [rows_a, K] activations
    w_ptr,  # [E, N, K / 8] int32
    scale_ptr,  # [E, N, K / GROUP]
    zero_ptr,  # [E, N, K / GROUP] uint8 (read with HAS_ZP)
    perm_ptr,  # [E, K] int32 (read with HAS_PERM)
    bias_ptr,  # [E, N] (read with HAS_BIAS)
    sorted_slots_ptr,  # [max_blocks * BLOCK_M] int32 (MOE): the slot of each padded row
    block_expert_ptr,  # [max_blocks] int32 (MOE): each BLOCK_M rows' expert, -1 past the end
    weight_ptr,  # [rows] float32 routing weights (read with MUL_WEIGHT)
    c_ptr,  # [rows, N] out
    num_rows,  # dense: the tokens; MOE: the slots
    max_blocks,  # MOE: the padded row blocks
    N: tl.constexpr,
    K: tl.constexpr,
    stride_am,
    stride_cm,
    FORMAT: tl.constexpr,
    GROUP: tl.constexpr,
    HAS_ZP: tl.constexpr,
    HAS_PERM: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    MUL_WEIGHT: tl.constexpr,
    MOE: tl.constexpr,
    A_ROW_DIV: tl.constexpr,
    DOT_F32: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    pid = tl.program_id(0)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    if MOE:
        num_pid_m = max_blocks
    else:
        num_pid_m = tl.cdiv(num_rows, BLOCK_M)
    # Programs in groups of GROUP_M row blocks, column block by column block (L2 reuse of w).
    in_group = GROUP_M * num_pid_n
    first_m = (pid // in_group) * GROUP_M
    group_m = min(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % in_group) % group_m
    pid_n = (pid % in_group) // group_m

    if MOE:
        expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
        if expert < 0:
            return
        rows = tl.load(sorted_slots_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    else:
        expert = 0
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    valid = rows < num_rows
    a_rows = (rows // A_ROW_DIV).to(tl.int64)
    KW: tl.constexpr = K // 8
    NUM_GROUPS: tl.constexpr = K // GROUP
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows_n = (offs_n % N).to(tl.int64)
    offs_w = tl.arange(0, BLOCK_K // 8)
    offs_k = tl.arange(0, BLOCK_K)
    shifts = tl.arange(0, 8) * 4
    w_rows = w_ptr + expert * N * KW + rows_n * KW  # [BLOCK_N]
    s_rows = expert * N * NUM_GROUPS + rows_n * NUM_GROUPS
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        in_k = k0 + offs_k < K
        col = k0 + offs_k
        if HAS_PERM:
            col = tl.load(perm_ptr + expert * K + col, mask=in_k, other=0)
        a = tl.load(a_ptr + a_rows[:, None] * stride_am + col[None, :],
                    mask=valid[:, None] & in_k[None, :], other=0.0)  # fmt: skip
        in_w = k0 // 8 + offs_w < KW
        q = tl.load(w_rows[:, None] + (k0 // 8 + offs_w)[None, :], mask=in_w[None, :], other=0)
        codes = (q[:, :, None] >> shifts[None, None, :]) & 0xF  # [BLOCK_N, BLOCK_K / 8, 8]
        group = k0 // GROUP
        scale = tl.load(scale_ptr + s_rows + group)  # [BLOCK_N]
        if FORMAT == 0:
            value = (codes | MAGIC).to(tl.float32, bitcast=True) - 8388608.0
            if HAS_ZP:
                zero = tl.load(zero_ptr + s_rows + group).to(tl.float32)
            else:
                zero = tl.full((BLOCK_N,), 8.0, tl.float32)
            w = (value - zero[:, None, None]) * scale.to(tl.float32)[:, None, None]
        else:
            w = _e2m1(codes) * _e8m0(scale)[:, None, None]
        w = tl.reshape(w.to(a.dtype), (BLOCK_N, BLOCK_K))
        if DOT_F32:
            acc = tl.dot(a.to(tl.float32), tl.trans(w.to(tl.float32)), acc)
        else:
            acc = tl.dot(a, tl.trans(w), acc)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + expert * N + rows_n).to(tl.float32)[None, :]
    if MUL_WEIGHT:
        acc = acc * tl.load(weight_ptr + rows, mask=valid, other=0.0)[:, None]
    c_ptrs = c_ptr + rows.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=valid[:, None] & (offs_n[None, :] < N))
