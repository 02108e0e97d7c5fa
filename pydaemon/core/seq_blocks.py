"""SeqBlocks: every change to a sequence's KV blocks, and what the model runner must learn.

The scheduler owns the only ``_core.BlockManager``; all its calls on sequences go through
here, so that one place records what changes for the runner: which sequences it must forget
(freed, preempted, swapped out), which block ids changed (a new block, a copy-on-write that
replaced the last one), and the copy-on-write pairs of the step. A sequence the runner does
not hold is sent whole the next time it is scheduled (``SchedulerOutput`` docstring).

KV tiers: ``allocate`` may load a prefix from the CPU or disk tier; the sequence may run from
``seq.ready_step`` on (``is_ready``), and ``take_tier_moves`` ends each step with its copies.

Sliding windows (``kv_window``: every layer attends within that many tokens): the blocks
wholly before the first key that a sequence's next query reads are released as it advances
(``release_outside_window``), so a windowed sequence holds about window / block_size blocks,
not its whole length. Their table entries become -1; the runner keeps its old ids for them
(the kernels never read a block wholly before the window, and the torch path masks it) and a
table sent whole shows them as block 0 (the caches are zero-filled: any block reads finite).

Per-layer-group tables (``kv_groups``, core/kv_groups.py: windowed and global layers mixed):
a sequence is one block-manager sequence per group, ids ``seq_id * G + g``, each with its
group's salt; they hold the same tokens and are allocated, grown, forked, swapped and freed
together, and a windowed group releases what leaves its window. The runner sees one table
per sequence, the groups interleaved: entry ``i * G + g`` is group g's block i.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from pydaemon import _core
from pydaemon.core.disk_blocks import DiskBlockRecord, DiskTierReport
from pydaemon.core.kv_groups import KVGroups
from pydaemon.core.request import PLACEHOLDER_TOKEN_ID, Sequence
from pydaemon.core.stats import KVCacheStats, KVTierStats
from pydaemon.lora_request import is_lora_salt

logger = logging.getLogger(__name__)


@dataclass
class TierMoves:
    """One step's copies between tiers (``SchedulerOutput``'s fields of the same names)."""

    blocks_to_save_to_cpu: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_save_ahead_to_cpu: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_load_from_cpu: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_write_to_disk: list[tuple[int, int]] = field(default_factory=list)
    disk_write_records: list[DiskBlockRecord] = field(default_factory=list)
    blocks_to_read_from_disk: list[tuple[int, int]] = field(default_factory=list)
    disk_read_records: list[DiskBlockRecord] = field(default_factory=list)


class SeqBlocks:
    def __init__(
        self,
        block_manager: _core.BlockManager,
        enable_prefix_caching: bool,
        *,
        has_tiers: bool = False,
        kv_block_bytes: int = 0,
        kv_window: int | None = None,
        kv_groups: KVGroups | None = None,
    ) -> None:
        """``has_tiers``: the block manager has a CPU tier; ``kv_block_bytes``: the bytes of
        one KV block over every tensor-parallel rank (for the tiers' byte counters)."""
        self.block_manager = block_manager
        self.block_size = block_manager.block_size()
        self.enable_prefix_caching = enable_prefix_caching
        self.has_tiers = has_tiers
        self.kv_block_bytes = kv_block_bytes
        self.kv_window = kv_window  # every layer's window (tokens); None: some layer sees all
        if kv_window is not None and kv_groups is not None:
            raise ValueError("kv_window (every layer windowed) and kv_groups exclude each other")
        self.kv_groups = kv_groups
        self.num_groups = 1 if kv_groups is None else kv_groups.num_groups
        # (group, window) of each windowed table, shortest window first
        self._windowed = (
            []
            if kv_groups is None
            else sorted(((g, w) for g, w in enumerate(kv_groups.windows) if w), key=lambda x: x[1])
        )
        self.releases_windows = kv_window is not None or bool(self._windowed)
        self.num_restored_disk_blocks = 0
        self.finished_seq_ids: list[int] = []  # the runner forgets these at the next step
        self.blocks_to_copy: list[tuple[int, int]] = []  # (src, dst) on the GPU, this step

    # ---- the runner's view ------------------------------------------------------------------
    def forget(self, seq: Sequence) -> None:
        """The runner drops its copy of ``seq`` before the next step."""
        if seq.is_in_runner:
            self.finished_seq_ids.append(seq.seq_id)
            seq.is_in_runner = False

    def take_block_delta(self, seq: Sequence) -> tuple[int, list[int]] | None:
        """(start, ids) of the block ids changed since the runner last heard, else None
        (groups: in the runner's interleaved table)."""
        start = seq.changed_block_start
        if start is None:
            return None
        seq.changed_block_start = None
        if self.num_groups == 1:
            return start, _readable(self.block_manager.block_table(seq.seq_id)[start:])
        return start * self.num_groups, self._interleaved(seq, start)

    def block_ids(self, seq: Sequence) -> list[int]:
        seq.changed_block_start = None
        if self.num_groups == 1:
            return _readable(self.block_manager.block_table(seq.seq_id))
        return self._interleaved(seq, 0)

    def _ids(self, seq: Sequence) -> list[int]:
        """The block manager's sequences of ``seq``: one per group."""
        g = self.num_groups
        return [seq.seq_id] if g == 1 else [seq.seq_id * g + i for i in range(g)]

    def _interleaved(self, seq: Sequence, start: int) -> list[int]:
        tables = [self.block_manager.block_table(i)[start:] for i in self._ids(seq)]
        return _readable([b for entries in zip(*tables, strict=True) for b in entries])

    def release_outside_window(self, seq: Sequence, first_query: int) -> None:
        """Release each windowed table's blocks wholly before the first key that a query at
        ``first_query`` (the earliest of the step being scheduled or any later one) reads."""
        if self.kv_window is not None:
            first_key = first_query - self.kv_window + 1
            if first_key >= self.block_size:
                self.block_manager.release_blocks_before(seq.seq_id, first_key)
            return
        g = self.num_groups
        for group, window in self._windowed:
            first_key = first_query - window + 1
            if first_key < self.block_size:
                return  # the longer windows release nothing either
            self.block_manager.release_blocks_before(seq.seq_id * g + group, first_key)

    # ---- block operations -------------------------------------------------------------------
    def can_allocate(self, seq: Sequence, cache_salt: str) -> _core.AllocStatus:
        """Whether ``seq``'s tokens fit now (OK), after others free blocks (LATER) or never."""
        if self.kv_groups is None:
            return self.block_manager.can_allocate(seq.token_ids(), cache_salt)
        return self.block_manager.can_allocate_group(
            seq.token_ids(), self.kv_groups.salts(cache_salt)
        )

    def allocate(self, seq: Sequence, cache_salt: str) -> int:
        """Blocks for every token of ``seq``; returns the number of prefix-cached tokens (in
        any tier: ``seq.ready_step`` says when the ones being loaded are readable)."""
        tokens = seq.token_ids()
        if self.kv_groups is None:
            num_cached = self.block_manager.allocate(seq.seq_id, tokens, cache_salt)
        else:
            num_cached = self.block_manager.allocate_group(
                self._ids(seq), tokens, self.kv_groups.salts(cache_salt)
            )
        seq.num_slots = len(tokens)
        seq.last_step_start = 0  # a recomputed sequence reads from its start again
        seq.ready_step = self.block_manager.seq_ready_step(seq.seq_id) if self.has_tiers else 0
        return num_cached

    # ---- tiers ------------------------------------------------------------------------------
    def step_index(self) -> int:
        """The index of the step being scheduled."""
        return self.block_manager.step_index()

    @staticmethod
    def is_ready(seq: Sequence, step_index: int) -> bool:
        """Whether the step ``step_index`` may read the sequence's KV (no load in flight)."""
        return seq.ready_step <= step_index

    def take_tier_moves(self) -> TierMoves:
        """Ends the step in the block manager: its copies between tiers, as plain data."""
        moves = self.block_manager.take_block_moves()
        if not self.has_tiers:
            return TierMoves()
        return TierMoves(
            blocks_to_save_to_cpu=moves.blocks_to_save_to_cpu,
            blocks_to_save_ahead_to_cpu=moves.blocks_to_save_ahead_to_cpu,
            blocks_to_load_from_cpu=moves.blocks_to_load_from_cpu,
            blocks_to_write_to_disk=moves.blocks_to_write_to_disk,
            disk_write_records=[_record(r) for r in moves.disk_write_records],
            blocks_to_read_from_disk=moves.blocks_to_read_from_disk,
            disk_read_records=[_record(r) for r in moves.disk_read_records],
        )

    def discard_tier_moves(self, moves: TierMoves) -> None:
        """The step that carried these copies never ran: forget what they were to copy, so
        that no block is served with content that never arrived. ``moves``: a TierMoves, or
        anything with its five lists of pairs (a SchedulerOutput)."""
        self.block_manager.discard_block_moves(
            _core.block_moves(
                moves.blocks_to_save_to_cpu,
                moves.blocks_to_save_ahead_to_cpu,
                moves.blocks_to_load_from_cpu,
                moves.blocks_to_write_to_disk,
                moves.blocks_to_read_from_disk,
            )
        )

    def restore_disk_blocks(self, records: list[DiskBlockRecord]) -> int:
        """Warm restart: enter the blocks a previous run left in the disk tier. Blocks
        computed under a LoRA adapter are left out: adapter ids are given per run, so the
        same id may name another adapter now. Returns the number entered."""
        kept = [r for r in records if not is_lora_salt(r.salt)]
        if len(kept) < len(records):
            logger.info(
                "disk tier: %d blocks computed under LoRA adapters are not reused after a restart",
                len(records) - len(kept),
            )
        native = [
            _core.DiskBlockRecord(
                r.disk_block, r.uid, r.parent_uid, r.hash, r.salt, list(r.token_ids)
            )
            for r in kept
        ]
        self.num_restored_disk_blocks = self.block_manager.restore_disk_blocks(native)
        if self.num_restored_disk_blocks < len(kept):
            logger.warning(
                "disk tier: %d of %d blocks found on disk are not reused (broken chain, bad "
                "hash or slot)",
                len(kept) - self.num_restored_disk_blocks,
                len(kept),
            )
        return self.num_restored_disk_blocks

    def apply_disk_report(self, report: DiskTierReport) -> set[int]:
        """A step's news of the disk tier: writes that did not land lose their disk copies, a
        write error stops the writes, and reads that did not deliver their block drop it
        from every tier. -> the ids of the sequences holding such a block: their KV from it
        on must be computed again (they have not run since: a read's block is readable two
        steps later, after this report)."""
        bm = self.block_manager
        if report.failed_writes:
            bm.forget_failed_disk_writes(report.failed_writes)
        if report.are_writes_stopped:
            bm.stop_disk_writes()
        if not report.failed_reads:
            return set()
        return {i // self.num_groups for i in bm.forget_failed_disk_reads(report.failed_reads)}

    def can_append_slots(self, seqs: list[Sequence]) -> bool:
        return self.block_manager.can_append_slots([i for s in seqs for i in self._ids(s)])

    def append_slot(self, seq: Sequence) -> None:
        """A slot for the sequence's last token (a new block or a copy-on-write, maybe)."""
        copied = False
        for i in self._ids(seq):
            pair = self.block_manager.append_slot(i, seq.last_token_id)
            if pair is not None:
                self.blocks_to_copy.append(pair)
                copied = True
        seq.num_slots += 1
        changed = None
        if copied:
            changed = (seq.num_slots - 1) // self.block_size  # the copied block's index
        elif (seq.num_slots - 1) % self.block_size == 0:
            changed = (seq.num_slots - 1) // self.block_size  # a new block
        if changed is not None and seq.is_in_runner:
            start = seq.changed_block_start
            seq.changed_block_start = changed if start is None else min(start, changed)

    def append_draft_slots(self, seq: Sequence, num_drafts: int) -> None:
        """Slots for ``num_drafts`` drafts past the sequence's tokens (speculative decoding:
        the runner writes their K/V while verifying them). Their ids are placeholders until
        ``accept_drafts``; ``seq.num_slots`` counts them meanwhile."""
        ids = self._ids(seq)
        for _ in range(num_drafts):
            pairs = [self.block_manager.append_slot(i, PLACEHOLDER_TOKEN_ID) for i in ids]
            seq.num_slots += 1
            changed = None
            if any(p is not None for p in pairs):
                self.blocks_to_copy.extend(p for p in pairs if p is not None)
                changed = (seq.num_slots - 1) // self.block_size
            elif (seq.num_slots - 1) % self.block_size == 0:
                changed = (seq.num_slots - 1) // self.block_size
            if changed is not None:
                self._note_changed(seq, changed)

    def accept_drafts(self, seq: Sequence, start: int, accepted: list[int]) -> None:
        """After a verify step: the draft slots from ``start`` keep the ``accepted`` ids, the
        rest are dropped with the blocks only they used (nothing leaks; only accepted ids are
        ever hashed for the prefix cache)."""
        num_blocks = len(self.block_manager.block_table(self._ids(seq)[0]))
        for i in self._ids(seq):
            self.block_manager.replace_tail(i, start, accepted)
        seq.num_slots = start + len(accepted)
        kept = -(-seq.num_slots // self.block_size)
        if kept < num_blocks:
            self._note_changed(seq, kept)  # the runner's table shrinks to ``kept`` blocks

    def _note_changed(self, seq: Sequence, block_index: int) -> None:
        if seq.is_in_runner:
            start = seq.changed_block_start
            seq.changed_block_start = block_index if start is None else min(start, block_index)

    def set_last_token(self, seq: Sequence) -> None:
        """The sequence's last token, which has a slot, replaced a placeholder: tell the
        block manager (the token's block is hashed only after this)."""
        for i in self._ids(seq):
            self.block_manager.set_last_token_id(i, seq.output_token_ids[-1])

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """``child`` shares every block of ``parent`` (it starts outside the runner)."""
        for p, c in zip(self._ids(parent), self._ids(child), strict=True):
            self.block_manager.fork(p, c)
        child.num_slots = parent.num_slots
        child.ready_step = parent.ready_step
        child.last_step_start = parent.last_step_start

    def free(self, seq: Sequence) -> None:
        for i in self._ids(seq):
            if self.block_manager.has_seq(i):
                self.block_manager.free(i)
        seq.num_slots = 0
        seq.last_step_start = 0
        self.forget(seq)

    def mark_computed(self, seq: Sequence) -> None:
        if self.enable_prefix_caching:
            for i in self._ids(seq):
                self.block_manager.mark_blocks_computed(i, seq.num_computed_tokens)

    def can_swap_out(self, seqs: list[Sequence]) -> bool:
        return self.block_manager.can_swap_out([i for s in seqs for i in self._ids(s)])

    def swap_out(self, seqs: list[Sequence]) -> list[tuple[int, int]]:
        """-> blocks_to_swap_out [(gpu, cpu)]; the runner forgets the sequences."""
        for seq in seqs:
            self.forget(seq)
        return self.block_manager.swap_out([i for s in seqs for i in self._ids(s)])

    def can_swap_in(self, seqs: list[Sequence]) -> _core.AllocStatus:
        return self.block_manager.can_swap_in([i for s in seqs for i in self._ids(s)])

    def swap_in(self, seqs: list[Sequence]) -> list[tuple[int, int]]:
        """-> blocks_to_swap_in [(cpu, gpu)]; each sequence is sent whole when scheduled."""
        for seq in seqs:
            seq.ready_step = 0  # swapped in before the step's writes
        return self.block_manager.swap_in([i for s in seqs for i in self._ids(s)])

    def num_used_gpu_blocks(self) -> int:
        return self.block_manager.num_used_blocks(_core.Device.GPU)

    def kv_cache_stats(self) -> KVCacheStats:
        """The block manager's figures, as plain data."""
        bm = self.block_manager
        return KVCacheStats(
            num_gpu_blocks=bm.num_total_blocks(_core.Device.GPU),
            num_free_gpu_blocks=bm.num_free_blocks(_core.Device.GPU),
            num_cpu_blocks=bm.num_total_blocks(_core.Device.CPU),
            num_free_cpu_blocks=bm.num_free_blocks(_core.Device.CPU),
            kv_waste_slots=bm.kv_waste(),
            num_shared_blocks=bm.num_shared_blocks(),
            prefix_cache_query_tokens=bm.prefix_cache_query_tokens(),
            prefix_cache_hit_tokens=bm.prefix_cache_hit_tokens(),
            kv_tiers=self._tier_stats() if self.has_tiers else None,
        )

    def _tier_stats(self) -> KVTierStats:
        bm, t, size = self.block_manager, self.block_manager.tier_stats(), self.kv_block_bytes
        return KVTierStats(
            gpu_hit_tokens=t.gpu_hit_tokens,
            cpu_hit_tokens=t.cpu_hit_tokens,
            disk_hit_tokens=t.disk_hit_tokens,
            gpu_to_cpu_bytes=t.num_saved_blocks * size,
            cpu_to_gpu_bytes=t.num_loaded_blocks * size,
            cpu_to_disk_bytes=t.num_written_blocks * size,
            disk_to_cpu_bytes=t.num_read_blocks * size,
            num_cpu_cached_blocks=bm.num_cached_blocks(_core.Device.CPU),
            num_disk_blocks=bm.num_total_blocks(_core.Device.DISK),
            num_disk_cached_blocks=bm.num_cached_blocks(_core.Device.DISK),
            num_dropped_loads=t.num_dropped_loads,
            num_restored_disk_blocks=self.num_restored_disk_blocks,
            num_failed_disk_reads=t.num_failed_disk_reads,
            num_failed_disk_writes=t.num_failed_disk_writes,
            are_disk_writes_stopped=t.are_disk_writes_stopped,
        )


def _record(r: _core.DiskBlockRecord) -> DiskBlockRecord:
    return DiskBlockRecord(r.disk_block, r.uid, r.parent_uid, r.hash, r.salt, tuple(r.token_ids))


def _readable(block_ids: list[int]) -> list[int]:
    """A table for the runner: released entries (-1, outside every window) as block 0."""
    return [b if b >= 0 else 0 for b in block_ids] if -1 in block_ids else block_ids
