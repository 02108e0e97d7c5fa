"""The tensor-core decode kernel's partition rule and kernel choice (host-side, any machine)."""

from __future__ import annotations

import pytest

from pydaemon.layers.attention import decode_kernel
from pydaemon.ops.paged_decode_tc import (
    DECODE_TC_MAX_GROUP,
    MAX_PARTITION,
    MIN_BLOCKS,
    WHOLE_BLOCKS,
    decode_tc_num_partitions,
    decode_tc_partition_size,
)


@pytest.mark.parametrize("num_seqs", [1, 2, 8, 32, 64, 66, 256, 512])
@pytest.mark.parametrize("num_kv_heads", [1, 2, 8])
@pytest.mark.parametrize("max_seq_len", [0, 1, 63, 64, 65, 256, 257, 512, 1000, 4096, 16384])
def test_partition_size_is_a_covering_multiple_of_64(num_seqs, num_kv_heads, max_seq_len):
    size = decode_tc_partition_size(num_seqs, num_kv_heads, max_seq_len)
    assert size > 0 and size % 64 == 0
    parts = decode_tc_num_partitions(max_seq_len, size)
    assert parts * size >= max_seq_len
    assert size < max_seq_len + 64 or max_seq_len <= 0 and size == 64  # never past one partition
    pairs = num_seqs * num_kv_heads
    if pairs >= WHOLE_BLOCKS or max_seq_len <= 64:
        assert parts == 1, "enough (sequence, kv head) pairs (or a short context): no split"
        return
    assert size <= MAX_PARTITION, "no partition longer than MAX_PARTITION below WHOLE_BLOCKS"
    if pairs >= MIN_BLOCKS:
        # As few partitions as MAX_PARTITION allows: one up to 1024 keys.
        assert parts == -(-max_seq_len // MAX_PARTITION)
    else:
        # A tiny batch: about MIN_BLOCKS / pairs partitions (more only past 1024 keys each).
        target_parts = -(-MIN_BLOCKS // pairs)
        assert parts <= max(target_parts, -(-max_seq_len // MAX_PARTITION))
        if size > 64 and size < MAX_PARTITION:
            assert decode_tc_num_partitions(max_seq_len, size - 64) > target_parts


def test_partition_rule_at_the_measured_shapes():
    # (batch, context) -> partition size, GQA 32/8: the sweep the rule comes from.
    expected = {(1, 1024): 128, (1, 4096): 512, (1, 16384): 1024, (8, 1024): 1024,
                (8, 16384): 1024, (64, 1024): 1024, (64, 16384): 1024, (256, 1024): 1024,
                (256, 16384): 16384, (512, 700): 704}  # fmt: skip
    for (batch, ctx), size in expected.items():
        assert decode_tc_partition_size(batch, 8, ctx) == size, (batch, ctx)


def test_one_partition_at_a_long_context_means_one_at_every_shorter():
    # The CUDA-graph plan relies on it: a bucket with one partition at the longest tier
    # captures one graph for every context.
    for num_seqs in (1, 4, 16, 40, 64, 66, 80, 512):
        for longest in (300, 2048, 8192, 32768):
            if (
                decode_tc_num_partitions(longest, decode_tc_partition_size(num_seqs, 8, longest))
                > 1
            ):
                continue
            for n in range(1, longest + 1, 37):
                size = decode_tc_partition_size(num_seqs, 8, n)
                assert decode_tc_num_partitions(n, size) == 1, (num_seqs, longest, n)


def test_decode_kernel_choice():
    assert decode_kernel(1, 128) == "cuda_cores"  # MHA
    for group in (2, 4, 8, DECODE_TC_MAX_GROUP):
        for head_dim in (64, 80, 96, 128, 256):
            assert decode_kernel(group, head_dim) == "tensor_cores"
    assert decode_kernel(DECODE_TC_MAX_GROUP + 1, 128) == "cuda_cores"
    assert decode_kernel(4, 112) == "cuda_cores"  # a head size the kernel is not built for
