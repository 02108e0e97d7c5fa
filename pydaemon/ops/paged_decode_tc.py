"""Paged decode attention on tensor cores, split-KV (1 to 16 query heads per kv head: GQA, MHA)."""

from __future__ import annotations

import torch

from pydaemon.ops._core_ext import arg, core, kv_cache_arg, stream_handle
from pydaemon.ops.paged_attention import decode_span, split_kv_workspaces

# Head sizes the kernel is built for (pagedd::cuda::decode_tc_is_built) and the largest
# group of query heads per kv head it takes (one mma atom of 16 rows).
DECODE_TC_HEAD_DIMS = (64, 80, 96, 128, 256)
DECODE_TC_MAX_GROUP = 16
# The split rule, from partition-size sweeps on the H200 (bench/bench_attention.py
# --tc-partition-sizes, bf16, head 128, GQA 32/8 and MHA 32/32; bench/results/
# h200_2026-12-01c_fp8_decode.md, h200_2026-12-02_decode_rule.md):
# - WHOLE_BLOCKS (sequence, kv head) pairs or more: no split. From 96 pairs up the context in
#   one partition was the fastest or within 2 % of it at 4k and 16k (decode_rule_sweep_*_h200_
#   2026-12-02_d52af53.json): GQA batch 12 x 16k 203.8 us against 229.6 in four partitions of
#   4,096 (SDPA 195.7), batch 16 x 4k 76.2 against 82.2 in four of 1,024, batch 32 x 16k
#   494.3 against 503.0, MHA batch 3 x 16k 201.6 against 226.9; one partition also needs no
#   reduce kernel.
# - An fp8 cache keeps splitting up to WHOLE_BLOCKS_FP8 pairs: each key costs half the bytes,
#   so a block's share of the context streams in half the time and more blocks in flight pay
#   off longer (batch 12 x 16k: 133.3 us in four partitions of 4,096 against 219.9 whole;
#   batch 16 x 16k 176.6 against 221.3; batch 12 x 4k 45.1 in four of 1,024 against 61.3).
# - Below it, about SPLIT_BLOCKS / pairs partitions of the context's bucket, of 64 to
#   MAX_PARTITION keys. Batch 1 x 1k: 8 partitions of 128 keys, 13.4 us against 14.3 with 256
#   and 20.2 with 1024; batch 1 x 16k: 1024 keys, 36.8 us against 41.8 with 256.
# - Where that is two partitions or fewer (from 64 pairs to the threshold), the partition is
#   the bucket / LONG_SPLIT keys, at least MAX_PARTITION: one partition up to 1k (batch 8 x
#   512: 13.9 us against 17.4 in two of 256), 1,024 keys at 4k (batch 8: 48.9 us against 55.2
#   in one partition), 4,096 at 16k (batch 8: 140.9 against 146.3 with 1,024).
# - The context enters only through its bucket (512, 2048, 8192, ...: x4), which are also the
#   CUDA-graph seq-len tiers (cuda_graph_inputs.py): a graph captured at a tier picks the
#   partition size eager picks for every context it serves, so their outputs are bitwise equal.
WHOLE_BLOCKS = 96
WHOLE_BLOCKS_FP8 = 512
SPLIT_BLOCKS = 128
MAX_PARTITION = 1024
LONG_SPLIT = 8
FIRST_CONTEXT_BUCKET = 512
CONTEXT_BUCKET_FACTOR = 4
# A window's partitions start at its first key rounded down to a multiple of this
# (pagedd::cuda::kDecodeTcWindowAlign: one 16-key sub-tile).
WINDOW_ALIGN = 16


def context_bucket(max_seq_len: int) -> int:
    """The smallest of 512, 2048, 8192, ... (x4) that holds max_seq_len keys."""
    bucket = FIRST_CONTEXT_BUCKET
    while bucket < max_seq_len:
        bucket *= CONTEXT_BUCKET_FACTOR
    return bucket


def decode_tc_partition_size(
    num_seqs: int, num_kv_heads: int, max_seq_len: int, fp8_cache: bool = False
) -> int:
    """Keys per split-KV partition for a decode step (a multiple of 64), from host values only.

    The rule above (fp8_cache: the cache is float8_e4m3fn); never more than one partition
    past max_seq_len. Depends only on its arguments, so a CUDA graph captured at a (batch,
    max_seq_len) shape launches the same grid at replay.
    """
    whole = max(64, -(-max_seq_len // 64) * 64)
    pairs = max(num_seqs * num_kv_heads, 1)
    if pairs >= (WHOLE_BLOCKS_FP8 if fp8_cache else WHOLE_BLOCKS):
        return whole
    bucket = context_bucket(max_seq_len)
    parts = -(-SPLIT_BLOCKS // pairs)
    if parts <= 2:
        size = max(MAX_PARTITION, bucket // LONG_SPLIT)  # a multiple of 64: bucket = 512 * 4^k
    else:
        size = -(-bucket // parts)
        size = min(MAX_PARTITION, max(64, -(-size // 64) * 64))
    return min(size, whole)


def decode_tc_num_partitions(max_seq_len: int, partition_size: int) -> int:
    return max(1, -(-max_seq_len // partition_size))


def paged_attention_decode_tc(
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
    partition_size: int | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of one new token per sequence over its paged KV cache, on tensor cores.

    The arguments and result are those of ``paged_attention_decode`` (ops/paged_attention.py):
    query [num_seqs, num_q_heads, head_dim] fp16/bf16; key_cache / value_cache [num_blocks,
    num_kv_heads, block_size, head_dim] of query's dtype or float8_e4m3fn (read as e4m3 *
    k_scale / v_scale); block_tables [num_seqs, max_blocks] int32; seq_lens [num_seqs] int32,
    each <= max_seq_len (host int: no device read; a longer sequence gets NaN, length 0 gets
    zeros); returns out [num_seqs, num_q_heads, head_dim].

    partition_size: keys per split-KV partition, a multiple of 64; None picks
                    ``decode_tc_partition_size(num_seqs, num_kv_heads, span, fp8_cache)``
                    with span = ``decode_span(max_seq_len, sliding_window, WINDOW_ALIGN)``,
                    the most keys a sequence spans (max_seq_len without a window).
    sliding_window, softcap, sinks: the layer's score modifiers, as
                    ``paged_attention_decode`` (ops/paged_attention.py) takes them.

    head_dim in DECODE_TC_HEAD_DIMS, at most DECODE_TC_MAX_GROUP query heads per kv head,
    block_size in {8, 16, 32}. Runs on the current stream of query's device; the workspaces
    (when there are several partitions) come from torch's caching allocator: graph-capturable.
    """
    _core = core()  # RuntimeError first when the kernels are unavailable
    num_seqs, _, head_dim = query.shape
    if scale is None:
        scale = head_dim**-0.5
    if out is None:
        out = torch.empty_like(query, memory_format=torch.contiguous_format)
    span = decode_span(max_seq_len, sliding_window, WINDOW_ALIGN)
    if partition_size is None:
        fp8_cache = key_cache.dtype == torch.float8_e4m3fn
        partition_size = decode_tc_partition_size(num_seqs, key_cache.shape[1], span, fp8_cache)
    if partition_size <= 0 or partition_size % 64 != 0:
        raise ValueError(f"partition_size must be a positive multiple of 64, got {partition_size}")
    parts = decode_tc_num_partitions(span, partition_size)
    tmp_out, exp_sums, max_logits = split_kv_workspaces(query, parts)
    _core.paged_attention_decode_tc(
        arg(out),
        arg(query),
        kv_cache_arg(key_cache),
        kv_cache_arg(value_cache),
        arg(block_tables),
        arg(seq_lens),
        float(scale),
        int(max_seq_len),
        int(partition_size),
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
