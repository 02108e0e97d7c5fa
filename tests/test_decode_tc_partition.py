"""The tensor-core decode kernel's partition rule and kernel choice (host-side, any machine)."""

from __future__ import annotations

import pytest

from pydaemon.layers.attention import decode_kernel
from pydaemon.ops.paged_decode_tc import (
    DECODE_TC_MAX_GROUP,
    LONG_SPLIT,
    MAX_PARTITION,
    SPLIT_BLOCKS,
    WHOLE_BLOCKS,
    WHOLE_BLOCKS_FP8,
    context_bucket,
    decode_tc_num_partitions,
    decode_tc_partition_size,
)
from pydaemon.worker.cuda_graph_inputs import capture_seq_len_tiers


@pytest.mark.parametrize("fp8_cache", [False, True])
@pytest.mark.parametrize("num_seqs", [1, 2, 8, 12, 32, 64, 66, 256, 512])
@pytest.mark.parametrize("num_kv_heads", [1, 2, 8])
@pytest.mark.parametrize("max_seq_len", [0, 1, 63, 64, 65, 256, 257, 512, 1000, 4096, 16384])
def test_partition_size_is_a_covering_multiple_of_64(
    num_seqs, num_kv_heads, max_seq_len, fp8_cache
):
    size = decode_tc_partition_size(num_seqs, num_kv_heads, max_seq_len, fp8_cache)
    assert size > 0 and size % 64 == 0
    parts = decode_tc_num_partitions(max_seq_len, size)
    assert parts * size >= max_seq_len
    assert size < max_seq_len + 64 or max_seq_len <= 0 and size == 64  # never past one partition
    pairs = num_seqs * num_kv_heads
    if pairs >= (WHOLE_BLOCKS_FP8 if fp8_cache else WHOLE_BLOCKS) or max_seq_len <= 64:
        assert parts == 1, "enough (sequence, kv head) pairs (or a short context): no split"
        return
    target_parts = -(-SPLIT_BLOCKS // pairs)
    bucket = context_bucket(max_seq_len)
    if target_parts <= 2:
        # Half the GPU's blocks or more: a bucket / LONG_SPLIT partition, at least MAX_PARTITION.
        assert size == min(max(MAX_PARTITION, bucket // LONG_SPLIT), -(-max_seq_len // 64) * 64)
        return
    assert 64 <= size <= MAX_PARTITION
    if parts == 1:
        return  # the context fits one partition of the rule's size
    # About SPLIT_BLOCKS / pairs partitions of the context's bucket: 64 keys less would
    # overshoot (unless MAX_PARTITION or the context itself bounds the size).
    assert decode_tc_num_partitions(bucket, size) <= target_parts or size in (64, MAX_PARTITION)
    if 64 < size < MAX_PARTITION:
        assert decode_tc_num_partitions(bucket, size - 64) > target_parts


def test_partition_rule_at_the_measured_shapes():
    # (batch, context) -> partition size, GQA 32/8: the sweeps the rule comes from. A 16-bit
    # cache runs the whole context in one partition from 12 sequences (96 pairs) ...
    expected = {(1, 1024): 128, (1, 4096): 512, (1, 16384): 1024, (8, 1024): 1024,
                (8, 4096): 1024, (8, 16384): 4096, (64, 1024): 1024, (64, 4096): 4096,
                (64, 16384): 16384, (256, 1024): 1024, (256, 16384): 16384, (512, 700): 704,
                (8, 512): 512, (1, 512): 64, (32, 16384): 16384, (12, 16384): 16384,
                (12, 4096): 4096, (16, 4096): 4096}  # fmt: skip
    for (batch, ctx), size in expected.items():
        assert decode_tc_partition_size(batch, 8, ctx) == size, (batch, ctx)
    # ... an fp8 cache from 64 sequences (512 pairs); it splits the same below 12.
    fp8 = {(12, 16384): 4096, (12, 4096): 1024, (16, 16384): 4096, (32, 16384): 4096,
           (32, 4096): 1024, (64, 4096): 4096, (64, 16384): 16384, (256, 1024): 1024}  # fmt: skip
    for (batch, ctx), size in fp8.items():
        assert decode_tc_partition_size(batch, 8, ctx, fp8_cache=True) == size, (batch, ctx)
    for (batch, ctx), size in expected.items():
        if batch < 12:
            assert decode_tc_partition_size(batch, 8, ctx, fp8_cache=True) == size, (batch, ctx)


@pytest.mark.parametrize("fp8_cache", [False, True])
@pytest.mark.parametrize("max_seq_len_to_capture", [512, 600, 2048, 5000, 8192, 32768])
def test_a_graph_tier_splits_every_context_it_serves_as_eager_does(
    max_seq_len_to_capture, fp8_cache
):
    # Graph and eager outputs are bitwise equal when each sequence's keys fall into the same
    # partitions: the same partition size, or one partition in both.
    tiers = capture_seq_len_tiers(max_seq_len_to_capture)
    for num_seqs in (1, 2, 3, 8, 12, 16, 40, 64, 66, 512):
        for n in range(1, max_seq_len_to_capture + 1, 23):
            tier = next(t for t in tiers if t >= n)
            eager = decode_tc_partition_size(num_seqs, 8, n, fp8_cache)
            graph = decode_tc_partition_size(num_seqs, 8, tier, fp8_cache)
            assert eager == graph or min(eager, graph) >= n, (num_seqs, n, tier, eager, graph)


def test_decode_kernel_choice():
    for group in (1, 2, 4, 8, DECODE_TC_MAX_GROUP):  # MHA included
        for head_dim in (64, 80, 96, 128, 256):
            assert decode_kernel(group, head_dim) == "tensor_cores"
    assert decode_kernel(DECODE_TC_MAX_GROUP + 1, 128) == "cuda_cores"
    assert decode_kernel(4, 112) == "cuda_cores"  # a head size the kernel is not built for
