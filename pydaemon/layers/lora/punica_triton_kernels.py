"""Triton kernels of the segmented LoRA path (SGMV, as Punica / S-LoRA): imported only by
pydaemon/layers/lora/punica_triton.py when a step takes that path (pydaemon imports without
triton).

Both kernels read the step's grouping (punica_grouped.slot_grouping: ``sorted_ids`` [T] int32,
the token of each row of the slot-ordered batch, and ``offsets`` [S + 1] int32, each slot's
cumulative end, the zero slot S last) and share one mapping of program ids to M-tiles: axis
``pid_m`` of ``cdiv(T, BLOCK_M) + min(S, T)`` programs (fixed by T and S: no value read back,
graph-capturable). Each program finds its (slot, tile) from the offsets of the adapter slots
0..S-1: a slot of c rows has cdiv(c, BLOCK_M) tiles, numbered slot after slot; at most
cdiv(T, BLOCK_M) + (slots with a token) tiles exist, and programs past the last one return at
once. The zero slot's rows (tokens without an adapter) have no tile: their delta is 0 and
their rows of y are never touched.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _slot_tile(pid_m, offsets_ptr, num_slots, BLOCK_M: tl.constexpr, SLOTS_PAD: tl.constexpr):
    """-> (slot, first row, end of the slot's rows); slot >= num_slots: no tile here."""
    idx = tl.arange(0, SLOTS_PAD)
    ends = tl.load(offsets_ptr + idx, mask=idx < num_slots, other=0)
    starts = tl.load(offsets_ptr + idx - 1, mask=(idx > 0) & (idx < num_slots), other=0)
    tiles = (ends - starts + BLOCK_M - 1) // BLOCK_M
    cum = tl.cumsum(tiles, 0)  # inclusive: tiles of slots 0..idx
    # The first slot whose tiles end past pid_m (cum is non-decreasing; padding adds none).
    slot = tl.sum((cum <= pid_m).to(tl.int32), 0)
    first_tile = tl.sum(tl.where(idx < slot, tiles, 0), 0)
    seg_start = tl.sum(tl.where(idx == slot, starts, 0), 0)
    seg_end = tl.sum(tl.where(idx == slot, ends, 0), 0)
    return slot, seg_start + (pid_m - first_tile) * BLOCK_M, seg_end


@triton.jit
def _part_of(col, end1, end2, end3):
    """The part (0..3) that column(s) ``col`` belong to."""
    return (col >= end1).to(tl.int32) + (col >= end2).to(tl.int32) + (col >= end3).to(tl.int32)


@triton.jit
def sgmv_shrink_kernel(
    x_ptr,  # [T, in]
    a_ptr,  # [S + 1, N, in] contiguous (N = n * R)
    xa_ptr,  # [T, SPLIT_K, N] float32: row r = the r-th row of the slot-ordered batch
    sorted_ids_ptr,  # [T] int32
    offsets_ptr,  # [S + 1] int32
    num_slots,  # S (the zero slot S is skipped)
    n_cols,  # N
    in_features,
    stride_x,
    stride_a_slot,
    stride_a_row,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    K_PER_SPLIT: tl.constexpr,  # a multiple of BLOCK_K
    SPLIT_K: tl.constexpr,
    SLOTS_PAD: tl.constexpr,
    DOT_F32: tl.constexpr,  # the interpreter's bf16 dot is wrong: float32 operands there
):
    """xa[row, k-split, cols] = x[sorted_ids[row], split's in-columns] @ A[slot][cols].T."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    slot, row0, seg_end = _slot_tile(pid_m, offsets_ptr, num_slots, BLOCK_M, SLOTS_PAD)
    if slot >= num_slots:
        return
    rows = row0 + tl.arange(0, BLOCK_M)
    row_mask = rows < seg_end
    tokens = tl.load(sorted_ids_ptr + rows, mask=row_mask, other=0).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < n_cols
    ks = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + tokens[:, None] * stride_x  # [BLOCK_M, 1]
    a_cols = a_ptr + slot.to(tl.int64) * stride_a_slot + cols[None, :] * stride_a_row
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_begin = pid_k * K_PER_SPLIT
    for k0 in range(0, K_PER_SPLIT, BLOCK_K):
        k = k_begin + k0 + ks
        k_mask = k < in_features
        xt = tl.load(x_rows + k[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        at = tl.load(a_cols + k[:, None], mask=k_mask[:, None] & col_mask[None, :], other=0.0)
        if DOT_F32:
            xt = xt.to(tl.float32)
            at = at.to(tl.float32)
        acc += tl.dot(xt, at)  # [BLOCK_M, BLOCK_K] @ [BLOCK_K, BLOCK_N], float32
    out = xa_ptr + rows[:, None] * (SPLIT_K * n_cols) + pid_k * n_cols + cols[None, :]
    tl.store(out, acc, mask=row_mask[:, None] & col_mask[None, :])


@triton.jit
def sgmv_expand_kernel(
    y_ptr,  # [T, OUT], updated in place
    xa_ptr,  # [T, SPLIT_K, N] float32 (the shrink's)
    b_ptr,  # [S + 1, R, OUT] contiguous
    sorted_ids_ptr,  # [T] int32
    offsets_ptr,  # [S + 1] int32
    num_slots,  # S
    n_cols,  # N = n * R: xa's columns
    out_features,  # OUT = sum(out_j)
    rank,  # R: part j's xa columns are [j * R, (j + 1) * R)
    end1,  # the first three parts' ends, OUT for parts that do not exist (<= 4 parts)
    end2,
    end3,
    stride_y,
    stride_b_slot,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,  # >= R, >= 16 (tl.dot)
    SPLIT_K: tl.constexpr,
    SLOTS_PAD: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    """y[sorted_ids[row], cols] += xa[row, part(col)] @ B[slot][:, cols], in y's dtype: each
    (row, column) of y is read and written by this one program (no atomics)."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    slot, row0, seg_end = _slot_tile(pid_m, offsets_ptr, num_slots, BLOCK_M, SLOTS_PAD)
    if slot >= num_slots:
        return
    rows = row0 + tl.arange(0, BLOCK_M)
    row_mask = rows < seg_end
    tokens = tl.load(sorted_ids_ptr + rows, mask=row_mask, other=0).to(tl.int64)
    col0 = pid_n * BLOCK_N
    cols = col0 + tl.arange(0, BLOCK_N)
    col_mask = cols < out_features
    rs = tl.arange(0, BLOCK_R)
    r_mask = rs < rank
    b_tile = tl.load(
        b_ptr + slot.to(tl.int64) * stride_b_slot + rs[:, None] * out_features + cols[None, :],
        mask=r_mask[:, None] & col_mask[None, :],
        other=0.0,
    )  # [BLOCK_R, BLOCK_N]: every part's B columns of this tile
    part = _part_of(cols, end1, end2, end3)  # [BLOCK_N]
    j_first = _part_of(col0, end1, end2, end3)
    j_last = _part_of(tl.minimum(col0 + BLOCK_N, out_features) - 1, end1, end2, end3)
    xa_rows = xa_ptr + rows[:, None] * (SPLIT_K * n_cols)
    xa_mask = row_mask[:, None] & r_mask[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for j in range(j_first, j_last + 1):  # the parts this column tile meets (mostly one)
        xa = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        for s in tl.static_range(SPLIT_K):
            xa += tl.load(xa_rows + s * n_cols + j * rank + rs[None, :], mask=xa_mask, other=0.0)
        # xa rounded to B's dtype for the tensor cores, float32 accumulate (as vLLM's expand)
        xa_lp = xa.to(b_tile.dtype)
        if DOT_F32:
            delta = tl.dot(xa_lp.to(tl.float32), b_tile.to(tl.float32))
        else:
            delta = tl.dot(xa_lp, b_tile)  # [BLOCK_M, BLOCK_N]
        acc += tl.where((part == j)[None, :], delta, 0.0)
    y_tile = y_ptr + tokens[:, None] * stride_y + cols[None, :]
    y_mask = row_mask[:, None] & col_mask[None, :]
    y_old = tl.load(y_tile, mask=y_mask, other=0.0)
    tl.store(y_tile, (y_old.to(tl.float32) + acc).to(y_old.dtype), mask=y_mask)


# Under TRITON_INTERPRET=1 (the CPU tests) jit functions are InterpretedFunction objects; that
# interpreter's tl.dot reads bfloat16 operands wrongly (triton 3.9: errors of ~1e10 where fp16
# and fp32 are exact), so its bf16 dots take float32 copies of the same (rounded) operands.
INTERPRETED = type(sgmv_shrink_kernel).__name__ == "InterpretedFunction"
