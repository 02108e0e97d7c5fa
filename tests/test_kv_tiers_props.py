"""Property test of the KV tiers: random steps of allocations, appends, forks, frees and
swaps over a tiny GPU pool, CPU pool and disk tier; each step computes every sequence whose
KV is readable.

A shadow model plays the runner: it holds what every block of every tier contains (the salt
and the token prefix whose KV it is) and applies each step's copies in the runner's order
(pydaemon/worker/kv_transfer.py): saves and swap-outs, swap-ins, copy-on-write, loads and
ahead saves, then the disk writes and reads; then the step's computes write their blocks. It
checks that

- a sequence, once its KV is readable (``seq_ready_step``), finds in every computed block
  exactly the KV of its own prefix, whichever tier the block came back from (also with every
  hash forced to collide);
- no copy of a step touches a block the step's computes write, and a step's copies never
  write a block another copy of the same step reads (the runner issues them concurrently);
- every block's reference count is its block-table references plus pins, the free lists
  hold exactly the unreferenced blocks, and at the end every block of every tier is free;
- a disk read that does not deliver its block (the runner's checks fail: the slot was changed
  underneath, or its write never landed) never reaches a sequence: reported after the step
  (``forget_failed_disk_reads``; under async scheduling, after the next step's moves were
  taken and its copies issued), it drops the block from every tier and the sequences holding
  it are preempted before they are ready. A failed write drops its disk copy and stops the
  writes.
"""

from __future__ import annotations

import random
from collections import Counter

import pytest
from hypothesis import HealthCheck, currently_in_test_context, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from pydaemon._core import AllocStatus, BlockManager, Device, NoFreeBlocksError

BLOCK_SIZE = 4
NUM_BLOCKS = {Device.GPU: 8, Device.CPU: 6, Device.DISK: 6}
GPU, CPU, DISK = Device.GPU, Device.CPU, Device.DISK

# Prompts share block-sized pieces so that hits in every tier and look-alikes are frequent.
BASES = ([0] * 12, [1, 1, 1, 1, 0, 0, 0, 0, 2, 2, 2, 2], [0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0])
token_lists = st.builds(
    lambda base, cut, tail: BASES[base][:cut] + tail or [0],
    st.integers(0, len(BASES) - 1),
    st.integers(0, 12),
    st.lists(st.integers(0, 2), max_size=5),
)
salts = st.sampled_from(["", "s"])
BAD = ("bad", ())  # what a failed disk read delivers, or a slot whose write failed holds
picks = st.integers(0, 1 << 16)  # which of the eligible sequences (or prompts) a rule takes


def _choose(items: list, pick: int):
    return items[pick % len(items)]


class KVTiersMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.bm: BlockManager | None = None
        self.tokens: dict[int, list[int]] = {}
        self.salt: dict[int, str] = {}
        self.computed: dict[int, int] = {}  # tokens whose KV the sequence's blocks hold
        self.content: dict[tuple[Device, int], tuple[str, tuple[int, ...]]] = {}
        self.next_id = 0
        # This step's work that the runner does when the step runs.
        self.swaps_out: list[tuple[int, int]] = []
        self.swaps_in: list[tuple[int, int]] = []
        self.copies: list[tuple[int, int]] = []
        self.computes: dict[int, int] = {}  # seq_id -> tokens the step computes
        self.appended: set[int] = set()  # sequences given a slot this step
        self.allocated: set[int] = set()  # sequences allocated this step
        self.is_step_started = False  # frees now are rollbacks, not aborts between steps
        self.history: list[tuple[tuple[int, ...], str]] = []  # prompts allocated so far
        self.seen: Counter[str] = Counter()  # steps with each kind of move
        self.is_report_late = False  # async scheduling: a step's report after the next take
        self.pending_report: tuple[list, list] | None = None  # (failed reads, failed writes)

    @initialize(collide=st.booleans(), save_ahead=st.integers(0, 3), late=st.booleans())
    def start(self, collide: bool, save_ahead: int, late: bool = False) -> None:
        n = NUM_BLOCKS
        self.bm = BlockManager(BLOCK_SIZE, n[GPU], n[CPU], 0.0, True, True, n[DISK], save_ahead)
        if collide:
            self.bm.set_hash_mask(0)
        self.is_report_late = late

    # ---- helpers ------------------------------------------------------------------------
    def _ids(self, device: Device) -> list[int]:
        return [s for s in sorted(self.tokens) if self.bm.seq_device(s) == device]

    def _is_ready(self, seq_id: int) -> bool:
        return self.bm.seq_ready_step(seq_id) <= self.bm.step_index()

    def _expected(self, seq_id: int, block_index: int) -> tuple[str, tuple[int, ...]]:
        end = min((block_index + 1) * BLOCK_SIZE, self.computed[seq_id])
        return self.salt[seq_id], tuple(self.tokens[seq_id][:end])

    def _forget(self, seq_id: int) -> None:
        for table in (self.tokens, self.salt, self.computed, self.computes):
            table.pop(seq_id, None)

    # ---- rules: what a scheduler does within a step ---------------------------------------
    @rule(token_ids=token_lists, salt=salts)
    def allocate(self, token_ids: list[int], salt: str) -> None:
        self._allocate(token_ids, salt)

    @precondition(lambda self: self.history)
    @rule(pick=picks)
    def allocate_again(self, pick: int) -> None:
        """A prompt seen before (a returning conversation): hits in whichever tier kept it."""
        token_ids, salt = _choose(self.history, pick)
        self._allocate(list(token_ids), salt)

    def _allocate(self, token_ids: list[int], salt: str) -> None:
        if (tuple(token_ids), salt) not in self.history:
            self.history.append((tuple(token_ids), salt))
        seq_id = self.next_id
        self.next_id += 1
        status = self.bm.can_allocate(token_ids, salt)
        try:
            num_cached = self.bm.allocate(seq_id, token_ids, salt)
        except NoFreeBlocksError:
            assert status != AllocStatus.OK
            return
        assert num_cached % BLOCK_SIZE == 0 and num_cached < len(token_ids)
        self.is_step_started = True
        self.allocated.add(seq_id)
        self.tokens[seq_id], self.salt[seq_id] = list(token_ids), salt
        self.computed[seq_id] = num_cached

    @precondition(lambda self: self.tokens)
    @rule(pick=picks, token=st.integers(0, 2))
    def append(self, pick: int, token: int) -> None:
        """A decode's slot for the token the last step sampled."""
        ids = [
            s
            for s in self._ids(GPU)
            if self.computed[s] == len(self.tokens[s]) and s not in self.appended
        ]
        if not ids:
            return
        seq_id = _choose(ids, pick)
        self.appended.add(seq_id)  # one slot per sequence and step
        self.is_step_started = True
        try:
            cow = self.bm.append_slot(seq_id, token)
        except NoFreeBlocksError:
            return
        if cow is not None:
            self.copies.append(cow)
        self.tokens[seq_id].append(token)

    # Forks come between steps, or before a step's copy-on-writes.
    @precondition(lambda self: self.tokens and not self.copies)
    @rule(pick=picks)
    def fork(self, pick: int) -> None:
        ids = [s for s in self._ids(GPU) if self.computed[s] == len(self.tokens[s])]
        if not ids:
            return
        parent = _choose(ids, pick)
        child = self.next_id
        self.next_id += 1
        self.bm.fork(parent, child)
        self.tokens[child] = list(self.tokens[parent])
        self.salt[child], self.computed[child] = self.salt[parent], self.computed[parent]

    @precondition(lambda self: self.tokens)
    @rule(pick=picks)
    def free(self, pick: int) -> None:
        """Finished or aborted between steps, or allocated in this step and let go again (an
        admission rolled back): then its loads are dropped."""
        ids = sorted(self.allocated) if self.is_step_started else sorted(self.tokens)
        if not ids:
            return
        seq_id = _choose(ids, pick)
        self.allocated.discard(seq_id)
        self.bm.free(seq_id)
        self._forget(seq_id)

    # A step swaps out (preempts) or swaps in, never both, and each sequence once: the
    # scheduler's order (pydaemon/core/sched/scheduler.py).
    @precondition(lambda self: self.tokens and not self.swaps_in)
    @rule(pick=picks)
    def swap_out(self, pick: int) -> None:
        """Preemption by swap, ready or not (a sequence whose load is in flight included).
        The scheduler preempts from the tail of its queue before it reserves that request's
        decode slots, so never a sequence given a slot (or allocated) this step."""
        moved = {s for s, _ in self.swaps_out}
        ids = [
            s
            for s in self._ids(GPU)
            if not set(self.bm.block_table(s)) & moved
            and s not in self.allocated
            and s not in self.appended
        ]
        if not ids:
            return
        seq_id = _choose(ids, pick)
        if self.bm.can_swap_out([seq_id]):
            self.swaps_out += self.bm.swap_out([seq_id])
            self.is_step_started = True

    @precondition(lambda self: self.tokens and not self.swaps_out)
    @rule(pick=picks)
    def swap_in(self, pick: int) -> None:
        moved = {d for _, d in self.swaps_in}
        ids = [s for s in self._ids(CPU) if not set(self.bm.block_table(s)) & moved]
        if not ids:
            return
        seq_id = _choose(ids, pick)
        if self.bm.can_swap_in([seq_id]) == AllocStatus.OK:
            self.swaps_in += self.bm.swap_in([seq_id])
            self.is_step_started = True

    # ---- the step: what the runner does with it -------------------------------------------
    @rule(damage=st.integers(0, 15))
    def run_step(self, damage: int = 8) -> None:
        """The step computes every ready sequence's uncomputed tokens; the runner copies.
        ``damage`` 0: the step's first disk read finds its slot changed underneath; 1: its
        first disk write fails."""
        bm, content = self.bm, self.content
        self.computes = {
            s: len(self.tokens[s])
            for s in self._ids(GPU)
            if self._is_ready(s) and self.computed[s] < len(self.tokens[s])
        }
        was_stopped = bm.tier_stats().are_disk_writes_stopped
        moves = bm.take_block_moves()
        assert not (was_stopped and moves.blocks_to_write_to_disk)
        to_cpu = moves.blocks_to_save_to_cpu + self.swaps_out
        background = (
            [(GPU, c) for _, c in moves.blocks_to_load_from_cpu]  # the GPU blocks it writes
            + [(CPU, c) for _, c in moves.blocks_to_save_ahead_to_cpu]
        )
        writes = [(CPU, c) for _, c in to_cpu] + [(GPU, g) for _, g in self.swaps_in]
        writes += [(GPU, d) for _, d in self.copies] + background
        reads = [(GPU, g) for g, _ in to_cpu] + [(CPU, c) for c, _ in self.swaps_in]
        reads += [(GPU, s) for s, _ in self.copies]
        reads += [(CPU, c) for c, _ in moves.blocks_to_load_from_cpu]
        reads += [(GPU, g) for g, _ in moves.blocks_to_save_ahead_to_cpu]
        assert len(set(writes)) == len(writes), "two copies of one step write one block"
        computed_blocks = {
            (GPU, b)
            for s, upto in self.computes.items()
            for b in bm.block_table(s)[self.computed[s] // BLOCK_SIZE : -(-upto // BLOCK_SIZE)]
        }
        # Loads and ahead saves run while the step's forward writes its blocks.
        assert not computed_blocks & set(background)
        assert not computed_blocks & {(GPU, g) for g, _ in moves.blocks_to_save_ahead_to_cpu}
        # The runner's order (kv_transfer.py).
        for pairs, src, dst in (
            (to_cpu, GPU, CPU),
            (self.swaps_in, CPU, GPU),
            (self.copies, GPU, GPU),
            (moves.blocks_to_load_from_cpu, CPU, GPU),
            (moves.blocks_to_save_ahead_to_cpu, GPU, CPU),
            (moves.blocks_to_write_to_disk, CPU, DISK),
            (moves.blocks_to_read_from_disk, DISK, CPU),
        ):
            for s, d in pairs:
                content[(dst, d)] = content.get((src, s))
        report = self._disk_damage(moves, damage)
        if self.is_report_late:  # the last step's report, after this step's take and copies
            report, self.pending_report = self.pending_report, report
        self._apply_report(report)
        for name in (
            "blocks_to_save_to_cpu",
            "blocks_to_save_ahead_to_cpu",
            "blocks_to_load_from_cpu",
            "blocks_to_write_to_disk",
            "blocks_to_read_from_disk",
        ):
            if getattr(moves, name):
                self.seen[name] += 1
                if currently_in_test_context():  # --hypothesis-show-statistics: how often
                    event(name)
        assert len(moves.disk_read_records) == len(moves.blocks_to_read_from_disk)
        for (d, _c), record in zip(
            moves.blocks_to_read_from_disk, moves.disk_read_records, strict=True
        ):
            assert record.disk_block == d and len(record.token_ids) == BLOCK_SIZE
        assert len(moves.disk_write_records) == len(moves.blocks_to_write_to_disk)
        for (_c, d), record in zip(
            moves.blocks_to_write_to_disk, moves.disk_write_records, strict=True
        ):
            assert record.disk_block == d and len(record.token_ids) == BLOCK_SIZE
            if content[(DISK, d)] == BAD:  # its write failed
                continue
            salt, prefix = content[(DISK, d)]
            assert (record.salt, tuple(record.token_ids)) == (salt, prefix[-BLOCK_SIZE:])
        for seq_id, upto in self.computes.items():
            if seq_id not in self.tokens:
                continue  # preempted by a failed read (it was never ready)
            table = bm.block_table(seq_id)
            for pos in range(self.computed[seq_id], upto):
                key = (GPU, table[pos // BLOCK_SIZE])
                content[key] = (self.salt[seq_id], tuple(self.tokens[seq_id][: pos + 1]))
            self.computed[seq_id] = upto
            bm.mark_blocks_computed(seq_id, upto)
        self.swaps_out, self.swaps_in, self.copies, self.computes = [], [], [], {}
        self.appended, self.allocated, self.is_step_started = set(), set(), False
        # Every ready sequence on the GPU reads its own prefix's KV, whatever tier it came from.
        for seq_id in self._ids(GPU):
            if not self._is_ready(seq_id):
                continue
            table = bm.block_table(seq_id)
            for i in range(self.computed[seq_id] // BLOCK_SIZE):
                assert content.get((GPU, table[i])) == self._expected(seq_id, i), (seq_id, i)

    def _disk_damage(self, moves, damage: int) -> tuple[list, list]:
        """The runner's checks of the step's disk I/O: a read of a slot whose content is not
        the block (damaged now, or a write that never landed) fails, and so does a damaged
        write. -> (failed reads, failed writes) as the runner reports them."""
        content = self.content
        failed_writes = []
        if damage == 1 and moves.blocks_to_write_to_disk:
            (_c, d), record = moves.blocks_to_write_to_disk[0], moves.disk_write_records[0]
            content[(DISK, d)] = BAD
            failed_writes.append((d, record.uid))
        failed_reads = []
        for i, ((d, c), record) in enumerate(
            zip(moves.blocks_to_read_from_disk, moves.disk_read_records, strict=True)
        ):
            if (damage == 0 and i == 0) or content.get((DISK, d)) == BAD:
                content[(CPU, c)] = BAD  # what the read delivered
                failed_reads.append((d, record.uid))
        if failed_reads or failed_writes:
            self.seen["failed disk I/O"] += 1
        return failed_reads, failed_writes

    def _apply_report(self, report: tuple[list, list] | None) -> None:
        """The scheduler's update_from_output: failed writes and reads leave the tiers; the
        sequences holding a failed read's block (none is ready yet) are preempted."""
        if report is None:
            return
        failed_reads, failed_writes = report
        bm = self.bm
        if failed_writes:
            bm.forget_failed_disk_writes(failed_writes)
            bm.stop_disk_writes()
        for seq_id in bm.forget_failed_disk_reads(failed_reads) if failed_reads else []:
            # It never ran since its read: not in this step (nor, being unready, any before).
            assert seq_id not in self.computes, "a failed read's block reached a sequence"
            assert self.computed[seq_id] < len(self.tokens[seq_id])
            bm.free(seq_id)
            self._forget(seq_id)
            self.allocated.discard(seq_id)

    # ---- invariants ---------------------------------------------------------------------
    @invariant()
    def pools_are_consistent(self) -> None:
        bm = self.bm
        if bm is None:
            return
        assert bm.seq_ids() == sorted(self.tokens)
        for device, total in NUM_BLOCKS.items():
            refs = [0] * total
            for seq_id in self._ids(device):
                for b in bm.block_table(seq_id):
                    refs[b] += 1
            pins = [bm.ref_count(b, device) - refs[b] for b in range(total)]
            assert min(pins) >= 0 and sum(pins) == bm.num_pinned_blocks(device)
            free = bm.free_block_ids(device)
            assert len(set(free)) == len(free) == bm.num_free_blocks(device)
            assert sorted(free) == [b for b in range(total) if bm.ref_count(b, device) == 0]
            assert bm.num_free_blocks(device) + bm.num_used_blocks(device) == total
            assert bm.num_cached_blocks(device) <= total

    def teardown(self) -> None:
        if self.bm is None:
            return
        for seq_id in list(self.tokens):
            self.bm.free(seq_id)
        # Idle steps until the last copies' pins are gone (a write-through waiting for a free
        # CPU block is tried again each step, and pins its block for two).
        devices = list(NUM_BLOCKS)
        for _ in range(20):
            self.bm.take_block_moves()
            if not any(self.bm.num_pinned_blocks(d) for d in devices):
                break
        for device, total in NUM_BLOCKS.items():
            assert self.bm.num_free_blocks(device) == total
            assert self.bm.num_pinned_blocks(device) == 0


KVTiersMachine.TestCase.settings = settings(
    max_examples=300,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestKVTiersMachine = KVTiersMachine.TestCase


@pytest.mark.parametrize("seed", range(3))
def test_long_random_walk(seed: int) -> None:
    """The same machine over long runs (hypothesis keeps its runs short): every tier path
    runs many times, with the same checks."""
    rng = random.Random(seed)
    m = KVTiersMachine()
    m.start(collide=seed == 1, save_ahead=1 + seed, late=seed == 2)

    def pick() -> int:
        return rng.randrange(1 << 16)

    rules = (
        (0.10, lambda: m.allocate(rng.choice(BASES)[: rng.randint(1, 12)] + [seed], "")),
        (0.30, lambda: m.history and m.allocate_again(pick())),
        (0.08, lambda: m.tokens and m.append(pick(), rng.randint(0, 2))),
        (0.02, lambda: m.tokens and not m.copies and m.fork(pick())),
        (0.20, lambda: m.tokens and m.free(pick())),
        (0.03, lambda: m.tokens and not m.swaps_in and m.swap_out(pick())),
        (0.03, lambda: m.tokens and not m.swaps_out and m.swap_in(pick())),
        # Seed 2: half the steps find their first disk read's slot changed underneath (failed
        # writes stop the writes: the machine's own examples try them).
        (0.24, lambda: m.run_step(0 if seed == 2 and rng.random() < 0.5 else 8)),
    )
    weights = [w for w, _ in rules]
    for _ in range(3000):
        rng.choices(rules, weights)[0][1]()
        m.pools_are_consistent()
    m.teardown()
    stats = m.bm.tier_stats()
    failed = m.seen.pop("failed disk I/O", 0)
    assert len(m.seen) == 5 and min(m.seen.values()) >= 5, m.seen
    assert (failed >= 3) == (seed == 2), failed
    assert stats.cpu_hit_tokens and stats.disk_hit_tokens and stats.gpu_hit_tokens
