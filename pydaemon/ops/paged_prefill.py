"""Paged prefill attention (packed new tokens of any lengths, causal) on the GPU."""

from __future__ import annotations

from typing import Literal

import torch

from pydaemon.ops._core_ext import arg, core, kv_cache_arg, stream_handle

PrefillBackend = Literal["auto", "mma", "wgmma"]
# PrefillBackend in cpp/cuda/pagedd_cuda.h
_BACKENDS: dict[str, int] = {"auto": 0, "mma": 1, "wgmma": 2}


def wgmma_unavailable_reason(head_dim: int, fp8_cache: bool = False) -> str | None:
    """Why backend="wgmma" cannot run this head size / cache on the current device (build
    without sm_90a, a GPU other than compute capability 9.0, ...), or None when it can."""
    return core().prefill_wgmma_unavailable_reason(int(head_dim), bool(fp8_cache)) or None


def paged_attention_prefill(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    max_query_len: int,
    scale: float | None = None,
    out: torch.Tensor | None = None,
    block_m: int = 0,
    block_n: int = 0,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    backend: PrefillBackend = "auto",
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of a step's new tokens over their paged K/V, one launch for the batch.

    query:           [num_tokens, num_q_heads, head_dim] fp16/bf16, last dim contiguous;
                     sequence s owns rows [query_start_loc[s], query_start_loc[s + 1])
    key_cache:       [num_blocks, num_kv_heads, block_size, head_dim] (kv_cache[:, l, 0]),
                     already holding this step's K (reshape_and_cache runs first)
    value_cache:     same shape, dtype and strides as key_cache; the dtype of query, or
                     float8_e4m3fn (read as e4m3 * k_scale / v_scale)
    block_tables:    [num_seqs, max_num_blocks_per_seq] int32 on the GPU
    seq_lens:        [num_seqs] int32 on the GPU, context length after this step; query token
                     j of sequence s sits at position seq_lens[s] - query_len_s + j
    query_start_loc: [num_seqs + 1] int32 on the GPU, cumulative query lengths
    max_query_len:   host int >= every query length: sizes the grid without a device read
                     (rows past it get NaN, as do sequences with query_len > seq_len)
    scale:           softmax scale, default head_dim ** -0.5
    out:             optional [num_tokens, num_q_heads, head_dim] contiguous output
    block_m, block_n: tile rows x keys (tuning; 0 = the default, see prefill_tile_shape and
                     prefill_wgmma_block_n in cpp/cuda/pagedd_cuda.h); wgmma: 128 x 64 or 128
    k_scale, v_scale: the fp8 cache's per-layer scales (ignored for other caches)
    backend:         "mma" (mma.sync, sm_80+, every case), "wgmma" (Hopper warpgroup MMA:
                     an sm_90a build on a compute capability 9.0 GPU, head_dim 64 / 128,
                     fp16 / bf16 cache, no window, sink or soft-cap; ValueError elsewhere) or
                     "auto" (wgmma at head 128 with the default tile for max_query_len >= 64
                     where it can run, else mma; mma with a window, sinks or a soft-cap)
    sliding_window:  keys a query sees, itself included (None: all); tiles of keys before
                     every row's window are skipped, blocks wholly before it never read
    softcap:         scaled scores s -> softcap * tanh(s / softcap) (None: none)
    sinks:           [num_q_heads], query's dtype: each head's sink logit, in the softmax's
                     denominator (None: none)
    returns          out: [num_tokens, num_q_heads, head_dim], dtype of query

    Query lengths of 1 (decode rows) may be mixed with prefill chunks. head_dim in
    {64, 80, 96, 128, 256}, block_size in {8, 16, 32}. Runs on the current stream.
    """
    if backend not in _BACKENDS:
        raise ValueError(f"backend must be one of {sorted(_BACKENDS)}, got {backend!r}")
    if sliding_window or softcap or sinks is not None:
        # The wgmma kernel's window / sink / soft-cap instances hung on the H200 (2026-12-04,
        # test_attention_mods_gpu.py, a window at head 64): layers with them take mma.sync.
        if backend == "wgmma":
            raise ValueError(
                "backend='wgmma' does not take a sliding window, sinks or a soft-cap yet: use "
                "'mma' (or 'auto', which does)"
            )
        backend = "mma"
    if scale is None:
        scale = query.shape[-1] ** -0.5
    if out is None:
        out = torch.empty_like(query, memory_format=torch.contiguous_format)
    core().paged_attention_prefill(
        arg(out),
        arg(query),
        kv_cache_arg(key_cache),
        kv_cache_arg(value_cache),
        arg(block_tables),
        arg(seq_lens),
        arg(query_start_loc),
        float(scale),
        int(max_query_len),
        int(block_m),
        int(block_n),
        float(k_scale),
        float(v_scale),
        _BACKENDS[backend],
        int(sliding_window or 0),
        float(softcap or 0.0),
        arg(sinks),
        stream_handle(query.device),
    )
    return out
