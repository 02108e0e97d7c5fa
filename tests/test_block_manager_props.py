"""Property test: random operation sequences keep the block manager's invariants.

After every step: each block's ref_count equals the number of block-table references to it
(per pool); a block is on the free list exactly when nothing references it; free + used ==
total; each table holds ceil(num_tokens / block_size) blocks. A shadow model of what every
block holds (the salt and the whole token prefix up to the block's last written slot) checks
that a prefix-cache hit only ever serves KV computed for the same prefix, also with every hash
forced to collide. At the end, freeing every sequence returns every block.
"""

from __future__ import annotations

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from pydaemon._core import AllocStatus, BlockManager, Device, NoFreeBlocksError

BLOCK_SIZE = 4
NUM_GPU_BLOCKS = 16
NUM_CPU_BLOCKS = 8
GPU, CPU = Device.GPU, Device.CPU

# Prompts share block-sized pieces ([0,0,0,0] is block 0 of one base and block 1 of another)
# so that hits, misses and look-alike blocks under another parent are all frequent.
BASES = ([0] * 12, [1, 1, 1, 1, 0, 0, 0, 0, 2, 2, 2, 2], [0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0])
token_lists = st.builds(
    lambda base, cut, tail: BASES[base][:cut] + tail or [0],
    st.integers(0, len(BASES) - 1),
    st.integers(0, 12),
    st.lists(st.integers(0, 2), max_size=5),
)
salts = st.sampled_from(["", "s"])


class BlockManagerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.bm = BlockManager(BLOCK_SIZE, NUM_GPU_BLOCKS, NUM_CPU_BLOCKS, 0.0)
        self.tokens: dict[int, list[int]] = {}
        self.salt: dict[int, str] = {}
        # (device, block_id) -> (salt, token prefix up to the block's last written slot)
        self.content: dict[tuple[Device, int], tuple[str, tuple[int, ...]]] = {}
        self.next_id = 0

    @initialize(collide=st.booleans())
    def set_mask(self, collide: bool) -> None:
        if collide:
            self.bm.set_hash_mask(0)

    # ---- helpers ------------------------------------------------------------------------

    def _ids(self, device: Device) -> list[int]:
        return [s for s in sorted(self.tokens) if self.bm.seq_device(s) == device]

    def _write(self, seq_id: int, pos: int) -> None:
        block = self.bm.block_table(seq_id)[pos // BLOCK_SIZE]
        assert block != -1, "a write into a released block"
        self.content[(GPU, block)] = (self.salt[seq_id], tuple(self.tokens[seq_id][: pos + 1]))

    def _snapshot(self) -> tuple:
        return (
            self.bm.free_block_ids(GPU),
            self.bm.free_block_ids(CPU),
            {s: (self.bm.block_table(s), self.bm.num_tokens(s)) for s in self.tokens},
            self.bm.num_cached_blocks(),
        )

    # ---- rules --------------------------------------------------------------------------

    @rule(token_ids=token_lists, salt=salts)
    def allocate(self, token_ids: list[int], salt: str) -> None:
        seq_id = self.next_id
        self.next_id += 1
        status = self.bm.can_allocate(token_ids, salt)
        before = self._snapshot()
        try:
            num_cached = self.bm.allocate(seq_id, token_ids, salt)
        except NoFreeBlocksError:
            assert status != AllocStatus.OK
            assert self._snapshot() == before
            return
        assert num_cached % BLOCK_SIZE == 0 and num_cached < len(token_ids)
        table = self.bm.block_table(seq_id)
        for i in range(num_cached // BLOCK_SIZE):  # hits hold exactly this prefix's KV
            expected = (salt, tuple(token_ids[: (i + 1) * BLOCK_SIZE]))
            assert self.content[(GPU, table[i])] == expected
        self.tokens[seq_id] = list(token_ids)
        self.salt[seq_id] = salt
        for pos in range(num_cached, len(token_ids)):
            self._write(seq_id, pos)

    @rule(token_ids=token_lists, salt=salts, num_groups=st.integers(2, 3))
    def allocate_group(self, token_ids: list[int], salt: str, num_groups: int) -> None:
        """Per-layer-group tables: one sequence per group, each with its own salt; the hit is
        the same in every table and serves only its group's KV; a refusal changes nothing."""
        ids = list(range(self.next_id, self.next_id + num_groups))
        self.next_id += num_groups
        group_salts = [salt + "\x1fg" * g for g in range(num_groups)]
        status = self.bm.can_allocate_group(token_ids, group_salts)
        before = self._snapshot()
        try:
            num_cached = self.bm.allocate_group(ids, token_ids, group_salts)
        except NoFreeBlocksError:
            assert status != AllocStatus.OK
            assert self._snapshot() == before
            return
        assert num_cached % BLOCK_SIZE == 0 and num_cached < len(token_ids)
        tables = [self.bm.block_table(i) for i in ids]
        assert len({b for t in tables for b in t}) == num_groups * len(tables[0])  # disjoint
        for seq_id, table, group_salt in zip(ids, tables, group_salts, strict=True):
            for i in range(num_cached // BLOCK_SIZE):
                expected = (group_salt, tuple(token_ids[: (i + 1) * BLOCK_SIZE]))
                assert self.content[(GPU, table[i])] == expected
            self.tokens[seq_id] = list(token_ids)
            self.salt[seq_id] = group_salt
            for pos in range(num_cached, len(token_ids)):
                self._write(seq_id, pos)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), token=st.integers(0, 2))
    def append(self, data: st.DataObject, token: int) -> None:
        gpu_ids = self._ids(GPU)
        if not gpu_ids:
            return
        seq_id = data.draw(st.sampled_from(gpu_ids))
        can = self.bm.can_append_slots([seq_id])
        before = self._snapshot()
        try:
            cow = self.bm.append_slot(seq_id, token)
        except NoFreeBlocksError:
            assert not can
            assert self._snapshot() == before
            return
        assert can
        if cow is not None:
            src, dst = cow
            self.content[(GPU, dst)] = self.content[(GPU, src)]
        self.tokens[seq_id].append(token)
        self._write(seq_id, len(self.tokens[seq_id]) - 1)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        parent = data.draw(st.sampled_from(sorted(self.tokens)))
        child = self.next_id
        self.next_id += 1
        self.bm.fork(parent, child)
        self.tokens[child] = list(self.tokens[parent])
        self.salt[child] = self.salt[parent]

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        seq_id = data.draw(st.sampled_from(sorted(self.tokens)))
        self.bm.free(seq_id)
        del self.tokens[seq_id], self.salt[seq_id]

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), frac=st.floats(0.0, 1.0))
    def release_before(self, data: st.DataObject, frac: float) -> None:
        """A sliding window: the blocks wholly before a token go (their entries become -1);
        prefix-cache hits on them stay exact (the content model keeps what they hold)."""
        gpu_ids = self._ids(GPU)
        if not gpu_ids:
            return
        seq_id = data.draw(st.sampled_from(gpu_ids))
        upto = int(frac * len(self.tokens[seq_id]))
        before = self.bm.num_released_blocks(seq_id)
        released = self.bm.release_blocks_before(seq_id, upto)
        after = self.bm.num_released_blocks(seq_id)
        assert after == max(before, upto // BLOCK_SIZE) and released == after - before
        table = self.bm.block_table(seq_id)
        assert table[:after] == [-1] * after and -1 not in table[after:]

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), frac=st.floats(0.0, 1.0))
    def mark_blocks_computed(self, data: st.DataObject, frac: float) -> None:
        gpu_ids = self._ids(GPU)
        if not gpu_ids:
            return
        seq_id = data.draw(st.sampled_from(gpu_ids))
        self.bm.mark_blocks_computed(seq_id, int(frac * len(self.tokens[seq_id])))

    def _swap(self, data: st.DataObject, src: Device, dst: Device) -> None:
        ids = self._ids(src)
        if not ids:
            return
        group = data.draw(st.lists(st.sampled_from(ids), min_size=1, unique=True))
        if src == GPU:
            can = self.bm.can_swap_out(group)
        else:
            can = self.bm.can_swap_in(group) != AllocStatus.NEVER
        before = self._snapshot()
        try:
            pairs = (self.bm.swap_out if src == GPU else self.bm.swap_in)(group)
        except NoFreeBlocksError:
            assert src == CPU or not can
            assert self._snapshot() == before
            return
        if src == GPU:
            assert can
        assert len({s for s, _ in pairs}) == len(pairs) == len({d for _, d in pairs})
        for s, d in pairs:
            self.content[(dst, d)] = self.content[(src, s)]
        for seq_id in group:
            assert self.bm.seq_device(seq_id) == dst

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def swap_out(self, data: st.DataObject) -> None:
        self._swap(data, GPU, CPU)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def swap_in(self, data: st.DataObject) -> None:
        self._swap(data, CPU, GPU)

    # ---- invariants ---------------------------------------------------------------------

    @invariant()
    def pools_are_consistent(self) -> None:
        bm = self.bm
        assert bm.seq_ids() == sorted(self.tokens)
        for device, total in ((GPU, NUM_GPU_BLOCKS), (CPU, NUM_CPU_BLOCKS)):
            refs = [0] * total
            for seq_id in self._ids(device):
                table = bm.block_table(seq_id)
                n = len(self.tokens[seq_id])
                assert bm.num_tokens(seq_id) == n
                assert len(table) == -(-n // BLOCK_SIZE)
                for b in table:
                    if b != -1:  # a block a sliding window released
                        refs[b] += 1
            assert [bm.ref_count(b, device) for b in range(total)] == refs
            free = bm.free_block_ids(device)
            assert len(set(free)) == len(free) == bm.num_free_blocks(device)
            assert sorted(free) == [b for b in range(total) if refs[b] == 0]
            assert bm.num_free_blocks(device) + bm.num_used_blocks(device) == total
        num_gpu_seqs = len(self._ids(GPU))
        assert 0 <= bm.kv_waste() <= num_gpu_seqs * (BLOCK_SIZE - 1)

    def teardown(self) -> None:
        for seq_id in list(self.tokens):
            self.bm.free(seq_id)
        assert self.bm.num_free_blocks(GPU) == NUM_GPU_BLOCKS
        assert self.bm.num_free_blocks(CPU) == NUM_CPU_BLOCKS
        assert all(self.bm.ref_count(b) == 0 for b in range(NUM_GPU_BLOCKS))


BlockManagerMachine.TestCase.settings = settings(
    max_examples=100,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestBlockManagerMachine = BlockManagerMachine.TestCase
