"""SeqBlocks: every change to a sequence's KV blocks, and what the model runner must learn.

The scheduler owns the only ``_core.BlockManager``; all its calls on sequences go through
here, so that one place records what changes for the runner: which sequences it must forget
(freed, preempted, swapped out), which block ids changed (a new block, a copy-on-write that
replaced the last one), and the copy-on-write pairs of the step. A sequence the runner does
not hold is sent whole the next time it is scheduled (``SchedulerOutput`` docstring).
"""

from __future__ import annotations

from pydaemon import _core
from pydaemon.core.request import PLACEHOLDER_TOKEN_ID, Sequence
from pydaemon.core.stats import KVCacheStats


class SeqBlocks:
    def __init__(self, block_manager: _core.BlockManager, enable_prefix_caching: bool) -> None:
        self.block_manager = block_manager
        self.block_size = block_manager.block_size()
        self.enable_prefix_caching = enable_prefix_caching
        self.finished_seq_ids: list[int] = []  # the runner forgets these at the next step
        self.blocks_to_copy: list[tuple[int, int]] = []  # (src, dst) on the GPU, this step

    # ---- the runner's view ------------------------------------------------------------------
    def forget(self, seq: Sequence) -> None:
        """The runner drops its copy of ``seq`` before the next step."""
        if seq.is_in_runner:
            self.finished_seq_ids.append(seq.seq_id)
            seq.is_in_runner = False

    def take_block_delta(self, seq: Sequence) -> tuple[int, list[int]] | None:
        """(start, ids) of the block ids changed since the runner last heard, else None."""
        start = seq.changed_block_start
        if start is None:
            return None
        seq.changed_block_start = None
        return start, self.block_manager.block_table(seq.seq_id)[start:]

    def block_ids(self, seq: Sequence) -> list[int]:
        seq.changed_block_start = None
        return self.block_manager.block_table(seq.seq_id)

    # ---- block operations -------------------------------------------------------------------
    def can_allocate(self, seq: Sequence, cache_salt: str) -> _core.AllocStatus:
        """Whether ``seq``'s tokens fit now (OK), after others free blocks (LATER) or never."""
        return self.block_manager.can_allocate(seq.token_ids(), cache_salt)

    def allocate(self, seq: Sequence, cache_salt: str) -> int:
        """Blocks for every token of ``seq``; returns the number of prefix-cached tokens."""
        tokens = seq.token_ids()
        num_cached = self.block_manager.allocate(seq.seq_id, tokens, cache_salt)
        seq.num_slots = len(tokens)
        return num_cached

    def can_append_slots(self, seqs: list[Sequence]) -> bool:
        return self.block_manager.can_append_slots([s.seq_id for s in seqs])

    def append_slot(self, seq: Sequence) -> None:
        """A slot for the sequence's last token (a new block or a copy-on-write, maybe)."""
        pair = self.block_manager.append_slot(seq.seq_id, seq.last_token_id)
        seq.num_slots += 1
        changed = None
        if pair is not None:
            self.blocks_to_copy.append(pair)
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
        for _ in range(num_drafts):
            pair = self.block_manager.append_slot(seq.seq_id, PLACEHOLDER_TOKEN_ID)
            seq.num_slots += 1
            changed = None
            if pair is not None:
                self.blocks_to_copy.append(pair)
                changed = (seq.num_slots - 1) // self.block_size
            elif (seq.num_slots - 1) % self.block_size == 0:
                changed = (seq.num_slots - 1) // self.block_size
            if changed is not None:
                self._note_changed(seq, changed)

    def accept_drafts(self, seq: Sequence, start: int, accepted: list[int]) -> None:
        """After a verify step: the draft slots from ``start`` keep the ``accepted`` ids, the
        rest are dropped with the blocks only they used (nothing leaks; only accepted ids are
        ever hashed for the prefix cache)."""
        num_blocks = len(self.block_manager.block_table(seq.seq_id))
        self.block_manager.replace_tail(seq.seq_id, start, accepted)
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
        self.block_manager.set_last_token_id(seq.seq_id, seq.output_token_ids[-1])

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """``child`` shares every block of ``parent`` (it starts outside the runner)."""
        self.block_manager.fork(parent.seq_id, child.seq_id)
        child.num_slots = parent.num_slots

    def free(self, seq: Sequence) -> None:
        if self.block_manager.has_seq(seq.seq_id):
            self.block_manager.free(seq.seq_id)
        seq.num_slots = 0
        self.forget(seq)

    def mark_computed(self, seq: Sequence) -> None:
        if self.enable_prefix_caching:
            self.block_manager.mark_blocks_computed(seq.seq_id, seq.num_computed_tokens)

    def can_swap_out(self, seqs: list[Sequence]) -> bool:
        return self.block_manager.can_swap_out([s.seq_id for s in seqs])

    def swap_out(self, seqs: list[Sequence]) -> list[tuple[int, int]]:
        """-> blocks_to_swap_out [(gpu, cpu)]; the runner forgets the sequences."""
        for seq in seqs:
            self.forget(seq)
        return self.block_manager.swap_out([s.seq_id for s in seqs])

    def can_swap_in(self, seqs: list[Sequence]) -> _core.AllocStatus:
        return self.block_manager.can_swap_in([s.seq_id for s in seqs])

    def swap_in(self, seqs: list[Sequence]) -> list[tuple[int, int]]:
        """-> blocks_to_swap_in [(cpu, gpu)]; each sequence is sent whole when scheduled."""
        return self.block_manager.swap_in([s.seq_id for s in seqs])

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
        )
