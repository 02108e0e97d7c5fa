"""Paged decode attention (one query token per sequence) on the GPU."""

from __future__ import annotations

import torch

from pydaemon.ops._core_ext import arg, core, kv_cache_arg, stream_handle

# Tokens per split-KV partition; must equal pagedd::cuda::kPartitionSize (checked on use).
PARTITION_SIZE = 256


def num_partitions(max_seq_len: int) -> int:
    """Split-KV partitions the kernel uses for a batch whose longest sequence spans
    max_seq_len keys (with a window: ``decode_span(max_seq_len, window)``)."""
    return max(1, -(-max_seq_len // PARTITION_SIZE))


def decode_span(max_seq_len: int, sliding_window: int | None, align: int = 1) -> int:
    """The most keys a decode step reads per sequence: a window's keys from its first key
    rounded down to a multiple of ``align`` (pagedd::cuda::decode_span)."""
    if not sliding_window:
        return max_seq_len
    return min(max_seq_len, sliding_window + align - 1)


def split_kv_workspaces(
    query: torch.Tensor, parts: int
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """-> (tmp_out [num_seqs, num_q_heads, parts, head_dim], exp_sums, max_logits [num_seqs,
    num_q_heads, parts]) float32 for a split-KV decode of ``query`` [num_seqs, num_q_heads,
    head_dim] over ``parts`` partitions; Nones for one partition. From torch's caching
    allocator: no sync, graph-capturable."""
    if parts <= 1:
        return None, None, None
    num_seqs, num_q_heads, head_dim = query.shape
    tmp_out = torch.empty(
        num_seqs, num_q_heads, parts, head_dim, dtype=torch.float32, device=query.device
    )
    exp_sums = torch.empty(num_seqs, num_q_heads, parts, dtype=torch.float32, device=query.device)
    return tmp_out, exp_sums, torch.empty_like(exp_sums)


def paged_attention_decode(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    max_seq_len: int,
    scale: float | None = None,
    out: torch.Tensor | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of one new token per sequence over its paged KV cache.

    query:        [num_seqs, num_q_heads, head_dim] fp16/bf16, last dim contiguous
    key_cache:    [num_blocks, num_kv_heads, block_size, head_dim], e.g. kv_cache[:, l, 0];
                  inner [block_size, head_dim] contiguous, any block / head stride
    value_cache:  same shape, dtype and strides as key_cache (kv_cache[:, l, 1]); the dtype
                  of query, or float8_e4m3fn (read as e4m3 * k_scale / v_scale)
    block_tables: [num_seqs, max_num_blocks_per_seq] int32 on the GPU
    seq_lens:     [num_seqs] int32 on the GPU, context length of each sequence (this token
                  included); every entry must be <= max_seq_len
    max_seq_len:  host int, max(seq_lens): picks the number of partitions without reading
                  the device (no host-device sync). A sequence longer than this gets NaN.
    scale:        softmax scale, default head_dim ** -0.5
    out:          optional [num_seqs, num_q_heads, head_dim] contiguous output
    k_scale, v_scale: the fp8 cache's per-layer scales (ignored for other caches)
    sliding_window: keys a query sees, itself included (None: all); blocks wholly before the
                  window are never read
    softcap:      scaled scores s -> softcap * tanh(s / softcap) (None: none)
    sinks:        [num_q_heads], query's dtype: each head's sink logit, in the softmax's
                  denominator (None: none)
    returns       out: [num_seqs, num_q_heads, head_dim], dtype of query

    head_dim in {64, 80, 96, 128, 256}, block_size in {8, 16, 32}, num_q_heads a multiple of
    num_kv_heads. Runs on the current stream of query's device.
    """
    _core = core()
    if _core.partition_size != PARTITION_SIZE:
        raise RuntimeError(
            f"pydaemon._core partition size {_core.partition_size} != {PARTITION_SIZE}; "
            "rebuild _core"
        )
    head_dim = query.shape[2]
    if scale is None:
        scale = head_dim**-0.5
    if out is None:
        out = torch.empty_like(query, memory_format=torch.contiguous_format)
    parts = num_partitions(decode_span(max_seq_len, sliding_window))
    tmp_out, exp_sums, max_logits = split_kv_workspaces(query, parts)
    _core.paged_attention_decode(
        arg(out),
        arg(query),
        kv_cache_arg(key_cache),
        kv_cache_arg(value_cache),
        arg(block_tables),
        arg(seq_lens),
        float(scale),
        int(max_seq_len),
        arg(tmp_out),
        arg(exp_sums),
        arg(max_logits),
        float(k_scale),
        float(v_scale),
        int(sliding_window or 0),
        float(softcap or 0.0),
        arg(sinks),
        stream_handle(query.device),
    )
    return out
