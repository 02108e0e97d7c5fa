"""The Triton kernels of the fused-MoE expert path (triton_moe.py launches them; this module
imports triton, so only triton_moe.py imports it, lazily).

``moe_align_kernel``: one program per expert (and one more for the tail) turns the experts of
the S = T * top_k slots into

- ``sorted_slots`` [max_blocks * BLOCK_M] int32: the slots of expert 0, padded with S up to a
  multiple of BLOCK_M, then those of expert 1, ... (slot order within an expert); an expert
  with no slot takes no row; rows past the last expert's are left unwritten;
- ``block_expert`` [max_blocks] int32: the expert of each BLOCK_M rows, -1 past the end.

Every program counts all slots per expert (a histogram: the sizes of the experts before its
own), then writes its own expert's rows and blocks. Nothing is read back to the host: the
buffers are sized by the most rows the padding can take, S + min(E, S) * (BLOCK_M - 1).

``moe_gemm_kernel``: one program per (BLOCK_M rows, BLOCK_N columns) tile of one expert:

    c[s, n] = [weight[s] *] sum_k a[s // A_ROW_DIV, k] * w[expert, n, k]

for the slots s of its rows (padding rows are masked out: read as zeros, never stored).
Called with x (A_ROW_DIV = top_k: each slot reads its token) and w13, then with the SiLU-and-
mul output (one row per slot) and w2 with the routing weight multiplied in the epilogue; the
output rows are the slots' (token, j) rows, so the top-k sum is a plain reduction afterwards.
Programs whose block is past the end return at once (the grid is sized by max_blocks).

``DOT_F32`` converts both operands to float32 before ``tl.dot``: Triton 3.9's interpreter (the
CPU tests, TRITON_INTERPRET=1) returns garbage from ``tl.dot`` on bfloat16 operands (numpy has
no bfloat16); on a GPU it is off and the tensor cores take bf16/fp16 operands as they are.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

# Whether the kernels below are the interpreter's (TRITON_INTERPRET=1 when this module was
# imported: @triton.jit reads it then).
try:
    INTERPRETED = bool(triton.knobs.runtime.interpret)
except AttributeError:  # triton < 3.4 has no knobs
    INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"


# The slot and block counts change with every batch size: not specialized on (a value of 1 or
# a multiple of 16 would otherwise compile another variant).
@triton.jit(do_not_specialize=["num_slots", "max_blocks"])
def moe_align_kernel(
    expert_ids_ptr,  # [S] int32: the expert of each slot
    sorted_slots_ptr,  # [max_blocks * BLOCK_M] int32, out
    block_expert_ptr,  # [max_blocks] int32, out
    num_slots,  # S
    max_blocks,
    NUM_EXPERTS: tl.constexpr,
    NUM_BINS: tl.constexpr,  # a power of two > NUM_EXPERTS: bin NUM_EXPERTS counts masked lanes
    BLOCK_M: tl.constexpr,
    CHUNK: tl.constexpr,
):
    expert = tl.program_id(0)  # NUM_EXPERTS + 1 programs: the last one writes the tail
    bins = tl.arange(0, NUM_BINS)
    counts = tl.zeros((NUM_BINS,), dtype=tl.int32)
    for start in range(0, num_slots, CHUNK):
        offs = start + tl.arange(0, CHUNK)
        ids = tl.load(expert_ids_ptr + offs, mask=offs < num_slots, other=NUM_EXPERTS)
        counts += tl.histogram(ids, NUM_BINS)
    counts = tl.where(bins < NUM_EXPERTS, counts, 0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, 0)
    if expert == NUM_EXPERTS:
        first = tl.sum(padded) // BLOCK_M  # blocks from here on have no expert
        for b in range(first, max_blocks, CHUNK):
            blocks = b + tl.arange(0, CHUNK)
            tl.store(block_expert_ptr + blocks, -1, mask=blocks < max_blocks)
        return
    mine = bins == expert
    end = tl.sum(tl.where(mine, ends, 0))
    size = tl.sum(tl.where(mine, padded, 0))
    count = tl.sum(tl.where(mine, counts, 0))
    row0 = end - size
    seen = 0
    for start in range(0, num_slots, CHUNK):
        offs = start + tl.arange(0, CHUNK)
        ids = tl.load(expert_ids_ptr + offs, mask=offs < num_slots, other=NUM_EXPERTS)
        hit = (ids == expert).to(tl.int32)
        rank = tl.cumsum(hit, 0)  # 1-based within this chunk
        tl.store(sorted_slots_ptr + row0 + seen + rank - 1, offs, mask=hit > 0)
        seen += tl.sum(hit)
    pad = count + tl.arange(0, BLOCK_M)
    tl.store(sorted_slots_ptr + row0 + pad, num_slots, mask=pad < size)
    last = end // BLOCK_M
    for b in range(row0 // BLOCK_M, last, CHUNK):
        blocks = b + tl.arange(0, CHUNK)
        tl.store(block_expert_ptr + blocks, expert, mask=blocks < last)


@triton.jit(do_not_specialize=["num_slots", "max_blocks"])
def moe_gemm_kernel(
    a_ptr,  # [rows, K]: x (rows = tokens) or the activations (rows = slots)
    w_ptr,  # [E, N, K]
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
    A_ROW_DIV: tl.constexpr,
    MUL_WEIGHT: tl.constexpr,
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
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + a_rows[:, None] * stride_am + offs_k[None, :]
    w_ptrs = (
        w_ptr
        + expert.to(tl.int64) * stride_we
        + (offs_n % N)[None, :] * stride_wn  # columns past N read row n % N, never stored
        + offs_k[:, None] * stride_wk
    )
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=valid[:, None], other=0.0)
            w = tl.load(w_ptrs)
        else:
            in_k = offs_k + k0 < K
            a = tl.load(a_ptrs, mask=valid[:, None] & in_k[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=in_k[:, None], other=0.0)
        if DOT_F32:
            a = a.to(tl.float32)
            w = w.to(tl.float32)
        acc = tl.dot(a, w, acc)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K * stride_wk
    if MUL_WEIGHT:
        acc = acc * tl.load(weight_ptr + slots, mask=valid, other=0.0)[:, None]
    c_ptrs = c_ptr + slots.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=valid[:, None] & (offs_n[None, :] < N))
