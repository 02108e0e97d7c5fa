"""Exact behaviour of pydaemon._core.BlockManager: block ids, free-list order, errors.

Conventions in these tests: block_size 4, token ids are small ints, `toks(n, start)` makes
n consecutive ids. The free list starts as 0..N-1 and allocation pops its head.
"""

from __future__ import annotations

import pytest

from pydaemon._core import (
    AllocStatus,
    BlockManager,
    BlockManagerError,
    Device,
    NoFreeBlocksError,
)

GPU, CPU = Device.GPU, Device.CPU


def toks(n: int, start: int = 0) -> list[int]:
    return list(range(start, start + n))


def make_bm(
    num_gpu_blocks: int = 8, num_cpu_blocks: int = 4, watermark: float = 0.0, **kw
) -> BlockManager:
    return BlockManager(4, num_gpu_blocks, num_cpu_blocks, watermark, **kw)


# ---- allocation, growth, free ------------------------------------------------------------


def test_allocate_pops_free_list_head() -> None:
    bm = make_bm()
    assert bm.allocate(1, toks(10)) == 0
    assert bm.block_table(1) == [0, 1, 2]
    assert bm.allocate(2, toks(4, 100)) == 0
    assert bm.block_table(2) == [3]
    assert bm.free_block_ids(GPU) == [4, 5, 6, 7]
    assert bm.num_used_blocks(GPU) == 4 and bm.num_free_blocks(GPU) == 4
    assert bm.num_tokens(1) == 10 and bm.seq_device(1) == GPU
    assert [bm.ref_count(b) for b in range(8)] == [1, 1, 1, 1, 0, 0, 0, 0]
    assert bm.seq_ids() == [1, 2]


def test_append_allocates_only_when_last_block_full() -> None:
    bm = make_bm()
    bm.allocate(1, toks(6))
    assert bm.kv_waste() == 2
    assert bm.append_slot(1, 6) is None
    assert bm.append_slot(1, 7) is None
    assert bm.block_table(1) == [0, 1]
    assert bm.kv_waste() == 0
    assert bm.append_slot(1, 8) is None
    assert bm.block_table(1) == [0, 1, 2]
    assert bm.num_tokens(1) == 9
    assert bm.kv_waste() == 3


def test_free_releases_last_block_first_to_head() -> None:
    bm = make_bm()
    bm.allocate(1, toks(8))  # [0, 1]
    bm.allocate(2, toks(8, 50))  # [2, 3]
    bm.free(1)
    assert bm.free_block_ids(GPU) == [0, 1, 4, 5, 6, 7]
    bm.allocate(3, toks(12, 90))
    assert bm.block_table(3) == [0, 1, 4]
    bm.free(2)
    bm.free(3)
    assert bm.free_block_ids(GPU) == [0, 1, 4, 2, 3, 5, 6, 7]
    assert not bm.has_seq(1)


# ---- fork and copy-on-write --------------------------------------------------------------


def test_fork_shares_every_block() -> None:
    bm = make_bm()
    bm.allocate(1, toks(6))
    bm.fork(1, 2)
    assert bm.block_table(2) == [0, 1]
    assert bm.num_tokens(2) == 6
    assert bm.ref_count(0) == 2 and bm.ref_count(1) == 2
    assert bm.num_shared_blocks() == 2
    assert bm.num_blocks_saved_by_sharing() == 2
    assert bm.num_used_blocks(GPU) == 2
    assert bm.kv_waste() == 2  # the shared partial block counts once
    bm.free(1)
    assert bm.ref_count(0) == 1 and bm.free_block_ids(GPU) == [2, 3, 4, 5, 6, 7]


def test_copy_on_write_of_shared_partial_block() -> None:
    bm = make_bm()
    bm.allocate(1, toks(6))
    bm.fork(1, 2)
    bm.fork(1, 3)
    assert bm.append_slot(2, 99) == (1, 2)
    assert bm.block_table(2) == [0, 2]
    assert bm.block_table(1) == [0, 1]
    assert bm.ref_count(1) == 2 and bm.ref_count(2) == 1 and bm.ref_count(0) == 3
    assert bm.append_slot(2, 98) is None  # own block now: no copy
    assert bm.append_slot(3, 97) == (1, 3)
    assert bm.append_slot(1, 96) is None  # last holder of block 1 writes in place
    assert bm.ref_count(1) == 1
    assert bm.num_shared_blocks() == 1


def test_no_copy_when_shared_last_block_is_full() -> None:
    bm = make_bm()
    bm.allocate(1, toks(8))
    bm.fork(1, 2)
    assert bm.append_slot(2, 5) is None
    assert bm.block_table(2) == [0, 1, 2]
    assert bm.ref_count(1) == 2


def test_can_append_slots_counts_new_and_cow_blocks() -> None:
    bm = make_bm(num_gpu_blocks=3)
    bm.allocate(1, toks(6))  # [0, 1], last partial
    bm.fork(1, 2)
    assert bm.can_append_slots([1])  # one COW block, one free
    assert not bm.can_append_slots([1, 2])  # two COW blocks needed
    bm.append_slot(1, 0)
    assert bm.block_table(1) == [0, 2]
    with pytest.raises(NoFreeBlocksError, match="needs 1 new GPU blocks, only 0 free"):
        bm.allocate(3, toks(1))
    assert bm.append_slot(2, 0) is None  # block 1 is seq 2's alone now
    assert bm.append_slot(2, 0) is None  # full: 8 tokens
    with pytest.raises(NoFreeBlocksError, match="append_slot: no free GPU block"):
        bm.append_slot(2, 0)
    assert bm.num_tokens(2) == 8 and bm.block_table(2) == [0, 1]


# ---- swap --------------------------------------------------------------------------------


def test_swap_out_and_back_keeps_sharing() -> None:
    bm = make_bm(num_cpu_blocks=4)
    bm.allocate(1, toks(6))  # [0, 1]
    bm.fork(1, 2)
    assert bm.append_slot(2, 9) == (1, 2)  # 1: [0, 1], 2: [0, 2]
    assert bm.can_swap_out([1, 2])
    assert bm.swap_out([1, 2]) == [(0, 0), (1, 1), (2, 2)]
    assert bm.block_table(1) == [0, 1] and bm.block_table(2) == [0, 2]
    assert bm.seq_device(1) == CPU and bm.seq_device(2) == CPU
    assert [bm.ref_count(b, CPU) for b in range(4)] == [2, 1, 1, 0]
    assert bm.free_block_ids(CPU) == [3]
    # GPU release order: seq 1 last block first (1, then 0 still held), then seq 2 (2, 0).
    assert bm.free_block_ids(GPU) == [0, 2, 1, 3, 4, 5, 6, 7]
    assert bm.kv_waste() == 0 and bm.num_used_blocks(GPU) == 0

    assert bm.can_swap_in([1, 2]) == AllocStatus.OK
    assert bm.swap_in([1, 2]) == [(0, 0), (1, 2), (2, 1)]
    assert bm.block_table(1) == [0, 2] and bm.block_table(2) == [0, 1]
    assert bm.ref_count(0) == 2 and bm.num_shared_blocks() == 1
    assert bm.free_block_ids(CPU) == [0, 2, 1, 3]  # same release order as on the GPU
    assert bm.seq_device(1) == GPU
    assert bm.num_tokens(2) == 7


def test_swap_out_copies_blocks_shared_outside_group() -> None:
    bm = make_bm()
    bm.allocate(1, toks(6))
    bm.fork(1, 2)
    assert bm.swap_out([1]) == [(0, 0), (1, 1)]
    assert bm.ref_count(0) == 1 and bm.ref_count(1) == 1  # still held by seq 2
    assert bm.ref_count(0, CPU) == 1
    assert bm.block_table(2) == [0, 1]


def test_swap_checks_and_errors() -> None:
    bm = make_bm(num_gpu_blocks=10, num_cpu_blocks=2, watermark=0.2)  # watermark 2 blocks
    bm.allocate(1, toks(12))  # 3 blocks
    assert not bm.can_swap_out([1])
    free_before = bm.free_block_ids(GPU)
    with pytest.raises(NoFreeBlocksError, match="swap_out"):
        bm.swap_out([1])
    assert bm.block_table(1) == [0, 1, 2] and bm.free_block_ids(GPU) == free_before
    with pytest.raises(BlockManagerError, match="sequence 1 is on the GPU"):
        bm.swap_in([1])
    with pytest.raises(BlockManagerError, match="listed twice"):
        bm.can_swap_out([1, 1])

    bm2 = make_bm(num_gpu_blocks=10, num_cpu_blocks=8, watermark=0.2)
    bm2.allocate(1, toks(28))  # 7 blocks
    bm2.swap_out([1])
    assert bm2.can_swap_in([1]) == AllocStatus.OK  # 7 + 1 <= 10 - 2
    bm2.allocate(2, toks(4, 100))
    assert bm2.can_swap_in([1]) == AllocStatus.LATER  # 8 > 9 - 2
    bm2.allocate(3, toks(4, 200))
    bm2.fork(1, 4)  # on the CPU: shares the CPU blocks
    assert bm2.ref_count(0, CPU) == 2
    assert bm2.can_swap_in([1, 4]) == AllocStatus.NEVER  # 7 + 2 > 10 - 2
    with pytest.raises(BlockManagerError, match="swapped out"):
        bm2.append_slot(1, 0)


# ---- prefix cache ------------------------------------------------------------------------


def test_prefix_cache_hit_and_counters() -> None:
    bm = make_bm()
    assert bm.allocate(1, toks(9)) == 0  # [0, 1, 2]
    assert bm.num_cached_blocks() == 0  # nothing computed yet
    bm.mark_blocks_computed(1, 5)
    assert bm.num_cached_blocks() == 1
    bm.mark_blocks_computed(1, 9)
    bm.mark_blocks_computed(1, 9)  # idempotent
    assert bm.num_cached_blocks() == 2
    assert bm.lookup_prefix(toks(9)) == ([0, 1], 8)
    assert bm.allocate(2, toks(10)) == 8
    assert bm.block_table(2) == [0, 1, 3]
    assert bm.ref_count(0) == 2 and bm.ref_count(1) == 2
    # Queries count the full blocks before the last prompt token: 8 + 8.
    assert bm.prefix_cache_query_tokens() == 16
    assert bm.prefix_cache_hit_tokens() == 8


def test_prefix_cache_miss_and_last_token_always_computed() -> None:
    bm = make_bm()
    bm.allocate(1, toks(8))
    bm.mark_blocks_computed(1, 8)
    assert bm.num_cached_blocks() == 2
    assert bm.allocate(2, toks(8, 1)) == 0  # different tokens
    assert bm.block_table(2) == [2, 3]
    # Whole prompt cached: the last block is recomputed so the model has logits.
    assert bm.allocate(3, toks(8)) == 4
    assert bm.block_table(3) == [0, 4]
    assert bm.lookup_prefix(toks(8)) == ([0, 1], 8)


def test_cached_free_blocks_go_to_tail_and_evict_lru() -> None:
    bm = make_bm(num_gpu_blocks=6)
    bm.allocate(1, toks(9))  # [0, 1, 2]
    bm.mark_blocks_computed(1, 9)  # 0 and 1 cached, 2 partial
    bm.free(1)
    # Uncached 2 goes to the head; cached blocks to the tail, last block first.
    assert bm.free_block_ids(GPU) == [2, 3, 4, 5, 1, 0]
    assert bm.num_cached_blocks() == 2
    bm.allocate(2, toks(16, 100))
    assert bm.block_table(2) == [2, 3, 4, 5]
    bm.allocate(3, toks(3, 200))
    assert bm.block_table(3) == [1]  # evicts the later block of the prefix first
    assert bm.num_cached_blocks() == 1
    assert bm.lookup_prefix(toks(9)) == ([0], 4)
    bm.free(2)  # uncached: to the head, free list [2, 3, 4, 5, 0]
    assert bm.free_block_ids(GPU) == [2, 3, 4, 5, 0]
    assert bm.allocate(4, toks(9)) == 4  # hit on the free cached block 0
    assert bm.block_table(4) == [0, 2, 3]
    assert bm.free_block_ids(GPU) == [4, 5]


def test_hit_on_free_cached_block_leaves_free_list() -> None:
    bm = make_bm(num_gpu_blocks=6)
    bm.allocate(1, toks(9))
    bm.mark_blocks_computed(1, 9)
    bm.free(1)
    assert bm.can_allocate(toks(9)) == AllocStatus.OK
    assert bm.allocate(2, toks(9)) == 8
    assert bm.block_table(2) == [0, 1, 2]
    assert bm.free_block_ids(GPU) == [3, 4, 5]


def test_salt_isolation() -> None:
    bm = make_bm(num_gpu_blocks=16)
    bm.allocate(1, toks(9), cache_salt="alice")
    bm.mark_blocks_computed(1, 9)
    assert bm.allocate(2, toks(9)) == 0
    assert bm.allocate(3, toks(9), cache_salt="bob") == 0
    assert bm.allocate(4, toks(9), cache_salt="alice") == 8
    assert bm.lookup_prefix(toks(9), "bob") == ([], 0)


def test_reset_prefix_cache_drops_only_free_blocks() -> None:
    bm = make_bm()
    bm.allocate(1, toks(5))
    bm.mark_blocks_computed(1, 5)
    bm.allocate(2, toks(5, 50))
    bm.mark_blocks_computed(2, 5)
    bm.free(1)
    assert bm.num_cached_blocks() == 2
    bm.reset_prefix_cache()
    assert bm.num_cached_blocks() == 1
    assert bm.lookup_prefix(toks(4)) == ([], 0)
    assert bm.lookup_prefix(toks(4, 50)) == ([2], 4)


def test_duplicate_block_is_not_registered_twice() -> None:
    bm = make_bm()
    bm.allocate(1, toks(5))  # [0, 1]
    bm.allocate(2, toks(5))  # computed concurrently: no hit yet, [2, 3]
    bm.mark_blocks_computed(1, 5)
    bm.mark_blocks_computed(2, 5)
    assert bm.num_cached_blocks() == 1
    bm.free(2)
    assert bm.free_block_ids(GPU)[:2] == [2, 3]  # uncached: to the head
    assert bm.lookup_prefix(toks(4)) == ([0], 4)


def test_forced_hash_collision_is_caught_by_tokens_and_parent() -> None:
    bm = make_bm()
    bm.set_hash_mask(0)  # every block hashes to 0
    bm.allocate(1, [1, 2, 3, 4, 5])  # a0 = 0
    bm.mark_blocks_computed(1, 5)
    bm.allocate(2, [9, 9, 9, 9, 5, 6, 7, 8, 0])  # c0 = 2, c1 = 3
    bm.mark_blocks_computed(2, 9)
    assert bm.num_cached_blocks() == 3
    assert bm.lookup_prefix([9, 9, 9, 9, 5, 6, 7, 8]) == ([2, 3], 8)
    # Same hash, other tokens: no hit.
    assert bm.lookup_prefix([7, 7, 7, 7]) == ([], 0)
    # Block 1 hits a0; c1 has the same tokens and hash but hangs under c0, not a0.
    assert bm.lookup_prefix([1, 2, 3, 4, 5, 6, 7, 8]) == ([0], 4)
    assert bm.lookup_prefix([1, 2, 3, 4], "salt") == ([], 0)
    assert bm.allocate(3, [1, 2, 3, 4, 5, 6, 7, 8, 9]) == 4
    bm.set_hash_mask(0xFFFFFFFFFFFFFFFF)
    assert bm.lookup_prefix([9, 9, 9, 9, 5, 6, 7, 8]) == ([2, 3], 8)


def test_evicted_parent_invalidates_cached_child() -> None:
    bm = make_bm(num_gpu_blocks=3)
    bm.allocate(1, toks(9))  # [0, 1, 2]
    bm.mark_blocks_computed(1, 8)
    bm.free(1)  # free list [2, 1, 0]
    bm.allocate(2, toks(3, 40))  # pops 2
    bm.allocate(3, toks(3, 50))  # pops 1 (the child)
    bm.free(3)
    bm.allocate(4, toks(3, 60))  # pops 1 again; 0 (parent) still cached
    assert bm.lookup_prefix(toks(8)) == ([0], 4)


def test_set_last_token_id_fixes_a_placeholder_before_hashing() -> None:
    """Async scheduling appends a slot with a placeholder id (-1) for a token still being
    sampled; the real id replaces it before the block is marked, so the cache holds it."""
    bm = make_bm()
    bm.allocate(1, toks(7))
    bm.append_slot(1, -1)  # position 7 fills block 1
    bm.set_last_token_id(1, 7)
    bm.mark_blocks_computed(1, 8)
    assert bm.lookup_prefix(toks(8)) == ([0, 1], 8)
    with pytest.raises(BlockManagerError, match="already hashed"):
        bm.set_last_token_id(1, 99)  # block 1 is in the cache now
    with pytest.raises(BlockManagerError, match="unknown sequence 5"):
        bm.set_last_token_id(5, 1)


def test_prefix_caching_disabled() -> None:
    bm = make_bm(enable_prefix_caching=False)
    bm.allocate(1, toks(9))
    bm.mark_blocks_computed(1, 9)
    assert bm.num_cached_blocks() == 0
    assert bm.allocate(2, toks(9)) == 0
    assert bm.prefix_cache_query_tokens() == 0


# ---- admission ---------------------------------------------------------------------------


def test_can_allocate_with_watermark() -> None:
    bm = make_bm(num_gpu_blocks=10, watermark=0.2)  # 2 blocks held back
    assert bm.can_allocate(toks(33)) == AllocStatus.NEVER  # 9 blocks > 10 - 2
    assert bm.can_allocate(toks(32)) == AllocStatus.OK  # 8 <= 10 - 2
    bm.allocate(1, toks(9))  # 3 blocks
    bm.mark_blocks_computed(1, 9)
    assert bm.can_allocate(toks(32, 100)) == AllocStatus.LATER  # 8 > 7 - 2
    assert bm.can_allocate(toks(20, 100)) == AllocStatus.OK  # 5 <= 5
    # Cached blocks in use are free of charge: 7 blocks, 2 of them hits.
    assert bm.can_allocate(toks(9) + toks(19, 500)) == AllocStatus.OK
    assert bm.can_allocate(toks(24, 100)) == AllocStatus.LATER


# ---- misuse ------------------------------------------------------------------------------


def test_misuse_raises_clear_errors() -> None:
    bm = make_bm()
    bm.allocate(1, toks(4))
    with pytest.raises(BlockManagerError, match="sequence 1 already exists"):
        bm.allocate(1, toks(4))
    with pytest.raises(BlockManagerError, match="unknown sequence 7"):
        bm.append_slot(7, 0)
    with pytest.raises(BlockManagerError, match="unknown sequence 7"):
        bm.fork(7, 8)
    with pytest.raises(BlockManagerError, match="child sequence 1 already exists"):
        bm.fork(1, 1)
    with pytest.raises(BlockManagerError, match="empty"):
        bm.allocate(2, [])
    with pytest.raises(BlockManagerError, match="num_computed_tokens=5"):
        bm.mark_blocks_computed(1, 5)
    with pytest.raises(BlockManagerError, match="block_id 8"):
        bm.ref_count(8)
    bm.free(1)
    with pytest.raises(BlockManagerError, match="free: unknown sequence 1"):
        bm.free(1)
    assert isinstance(BlockManagerError("x"), RuntimeError)
    assert issubclass(NoFreeBlocksError, BlockManagerError)


def test_pool_exhausted_leaves_state_unchanged() -> None:
    bm = make_bm(num_gpu_blocks=4)
    bm.allocate(1, toks(5))
    bm.mark_blocks_computed(1, 5)
    free_before = bm.free_block_ids(GPU)
    with pytest.raises(NoFreeBlocksError, match="sequence 2 needs 5 new GPU blocks, only 2 free"):
        bm.allocate(2, toks(20, 100))
    assert bm.free_block_ids(GPU) == free_before
    assert not bm.has_seq(2)
    assert bm.num_cached_blocks() == 1
    assert bm.prefix_cache_query_tokens() == 4


@pytest.mark.parametrize(
    ("args", "match"),
    [
        ((0, 8, 0), "block_size"),
        ((4, 0, 0), "num_gpu_blocks"),
        ((4, 8, -1), "num_cpu_blocks"),
        ((4, 8, 0, 1.0), "watermark"),
        ((4, 8, 0, -0.1), "watermark"),
    ],
)
def test_constructor_rejects_bad_sizes(args: tuple, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        BlockManager(*args)
