"""Iteration-level scheduling: who runs this step, under a token budget and the KV blocks.

Policy lives here; memory lives in the C++ block manager; tensors never appear. Each step:

1. decodes of running requests (one token per sequence), in priority order; when a sequence
   cannot get a slot, the lowest-priority, latest-arrived running request is preempted
   (recompute: its blocks are freed and it is requeued; swap: its blocks move to the CPU pool);
2. prefill chunks of running requests whose prompt is not yet fully computed (chunked
   prefill: a long prompt takes what is left of the budget and never stalls decodes);
3. swapped requests come back when the GPU pool allows (not in a step that preempted);
4. waiting requests are admitted in order while blocks, ``max_num_seqs`` and the budget allow
   (prefix-cache hits make their first tokens free).

``schedule()`` returns a plain ``SchedulerOutput``; ``update_after_step()`` records what the
model runner computed.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from pydaemon import _core
from pydaemon.request import Request, RequestStatus, Sequence


@dataclass
class ScheduledSeq:
    request: Request
    seq: Sequence
    num_new_tokens: int  # tokens whose K/V this step computes

    @property
    def do_sample(self) -> bool:
        return self.seq.num_computed_tokens + self.num_new_tokens == self.seq.num_tokens


@dataclass
class SchedulerOutput:
    prefills: list[ScheduledSeq] = field(default_factory=list)  # query_len >= 1, first
    decodes: list[ScheduledSeq] = field(default_factory=list)  # query_len == 1
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)  # (gpu, cpu)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)  # (cpu, gpu)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)  # (src, dst) on GPU
    preempted: list[Request] = field(default_factory=list)
    rejected: list[tuple[Request, str]] = field(default_factory=list)  # can never run

    @property
    def scheduled(self) -> list[ScheduledSeq]:
        return self.prefills + self.decodes

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.prefills) + len(self.decodes)

    @property
    def is_empty(self) -> bool:
        return not (self.prefills or self.decodes or self.blocks_to_swap_out or self.rejected)


@dataclass
class SchedulerStats:
    num_preemptions: int = 0
    num_swapped_out_blocks: int = 0
    num_swapped_in_blocks: int = 0


class Scheduler:
    def __init__(
        self,
        block_manager: _core.BlockManager,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        preemption_mode: str = "auto",
        enable_prefix_caching: bool = True,
    ) -> None:
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.preemption_mode = preemption_mode
        self.enable_prefix_caching = enable_prefix_caching
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.swapped: list[Request] = []
        self.stats = SchedulerStats()

    # ---- queues -----------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        bisect.insort(self.waiting, request, key=lambda r: r.sort_key)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def num_running_seqs(self) -> int:
        return sum(len(r.seqs) for r in self.running)

    def remove_request(self, request: Request) -> None:
        """Take a request out of every queue and free all its blocks at once."""
        for queue in (self.waiting, self.running, self.swapped):
            if request in queue:
                queue.remove(request)
        for seq in request.seqs:
            self.free_seq(seq)

    def free_seq(self, seq: Sequence) -> None:
        if self.block_manager.has_seq(seq.seq_id):
            self.block_manager.free(seq.seq_id)
        seq.num_slots = 0

    # ---- the step ---------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        # 1. Decodes of running requests, preempting from the tail when blocks run out.
        index = 0
        while index < len(self.running):
            request = self.running[index]
            decoding = [
                s
                for s in request.seqs
                if s.num_computed_tokens >= len(s.prompt_token_ids) and s.num_uncomputed_tokens == 1
            ]
            if not decoding:
                index += 1
                continue
            if len(decoding) > budget:
                index += 1  # budget spent; it keeps its blocks and runs next step
                continue
            if not self._reserve_decode_slots(request, decoding, out):
                continue  # preempted itself: running[index] is now the next request
            for seq in decoding:
                out.decodes.append(ScheduledSeq(request, seq, 1))
            budget -= len(decoding)
            index += 1
        # 2. Prefill chunks of running requests.
        decoding_ids = {s.seq.seq_id for s in out.decodes}  # a set: this runs per sequence
        for request in self.running:
            for seq in request.seqs:
                if budget == 0:
                    break
                if seq.num_uncomputed_tokens == 0 or seq.seq_id in decoding_ids:
                    continue
                budget -= self._schedule_prefill(request, seq, budget, out)
        # 3. Swapped requests come back, unless this step had to preempt.
        if not out.preempted:
            while self.swapped and budget > 0:
                request = self.swapped[0]
                if not self._swap_in(request, out):
                    break
                if request.status != RequestStatus.RUNNING:
                    continue  # rejected
                for seq in request.seqs:
                    budget -= self._schedule_after_resume(request, seq, budget, out)
        # 4. Admit waiting requests.
        if not out.preempted and not self.swapped:
            while self.waiting and budget > 0:
                request = self.waiting[0]
                if self.num_running_seqs() + request.num_expected_seqs > self.max_num_seqs:
                    break
                admitted = self._admit(request, out)
                if admitted is None:
                    continue  # rejected: try the next one
                if not admitted:
                    break  # head of line waits for blocks
                for seq in request.seqs:
                    budget -= self._schedule_after_resume(request, seq, budget, out)
        return out

    def update_after_step(self, out: SchedulerOutput) -> None:
        """Record the K/V this step computed and offer full blocks to the prefix cache."""
        for scheduled in out.scheduled:
            seq = scheduled.seq
            seq.num_computed_tokens += scheduled.num_new_tokens
            if self.enable_prefix_caching:
                self.block_manager.mark_blocks_computed(seq.seq_id, seq.num_computed_tokens)

    # ---- helpers ----------------------------------------------------------------------------
    def _reserve_decode_slots(
        self, request: Request, decoding: list[Sequence], out: SchedulerOutput
    ) -> bool:
        """Give each decoding sequence a slot for its last token, preempting if needed."""
        bm = self.block_manager
        needing = [s for s in decoding if s.num_slots < s.num_tokens]
        while not bm.can_append_slots([s.seq_id for s in needing]):
            victim = self.running[-1]
            self._preempt(victim, out)
            if victim is request:
                return False
        for seq in needing:
            pair = bm.append_slot(seq.seq_id, seq.last_token_id)
            seq.num_slots += 1
            if pair is not None:
                out.blocks_to_copy.append(pair)
        return True

    def _schedule_prefill(
        self, request: Request, seq: Sequence, budget: int, out: SchedulerOutput
    ) -> int:
        num_new = min(seq.num_uncomputed_tokens, budget)
        if num_new <= 0:
            return 0
        out.prefills.append(ScheduledSeq(request, seq, num_new))
        return num_new

    def _schedule_after_resume(
        self, request: Request, seq: Sequence, budget: int, out: SchedulerOutput
    ) -> int:
        """Schedule a sequence that just got its blocks (admitted or swapped in)."""
        if seq.num_slots < seq.num_tokens:  # swapped in while decoding: needs one more slot
            if not self.block_manager.can_append_slots([seq.seq_id]):
                return 0
            pair = self.block_manager.append_slot(seq.seq_id, seq.last_token_id)
            seq.num_slots += 1
            if pair is not None:
                out.blocks_to_copy.append(pair)
        return self._schedule_prefill(request, seq, budget, out)

    def _admit(self, request: Request, out: SchedulerOutput) -> bool | None:
        """Allocate blocks for a waiting request. True: admitted; False: later; None: rejected."""
        bm = self.block_manager
        if not request.seqs:
            request.seqs.append(Sequence.new(0, request.prompt_token_ids))
        statuses = [bm.can_allocate(s.token_ids(), request.cache_salt) for s in request.seqs]
        if _core.AllocStatus.NEVER in statuses:
            self.waiting.pop(0)
            out.rejected.append(
                (request, f"request {request.request_id!r} needs more KV blocks than the cache has")
            )
            return None
        if _core.AllocStatus.LATER in statuses:
            return False
        allocated: list[Sequence] = []
        try:
            for seq in request.seqs:
                tokens = seq.token_ids()
                num_cached = bm.allocate(seq.seq_id, tokens, request.cache_salt)
                allocated.append(seq)
                # The last token is always computed so that the step yields its logits.
                seq.num_computed_tokens = min(num_cached, len(tokens) - 1)
                seq.num_slots = len(tokens)
                if seq is request.seqs[0] and request.metrics.first_scheduled_time is None:
                    request.metrics.num_cached_tokens = seq.num_computed_tokens
        except _core.NoFreeBlocksError:
            for seq in allocated:
                self.free_seq(seq)
            return False
        self.waiting.pop(0)
        request.status = RequestStatus.RUNNING
        bisect.insort(self.running, request, key=lambda r: r.sort_key)
        return True

    def _swap_in(self, request: Request, out: SchedulerOutput) -> bool:
        bm = self.block_manager
        seq_ids = [s.seq_id for s in request.seqs]
        status = bm.can_swap_in(seq_ids)
        if status == _core.AllocStatus.NEVER:
            self.swapped.pop(0)
            out.rejected.append(
                (request, f"request {request.request_id!r} no longer fits the KV cache")
            )
            return True
        if status != _core.AllocStatus.OK:
            return False
        if self.num_running_seqs() + len(seq_ids) > self.max_num_seqs:
            return False
        pairs = bm.swap_in(seq_ids)
        out.blocks_to_swap_in.extend(pairs)
        self.stats.num_swapped_in_blocks += len(pairs)
        self.swapped.pop(0)
        request.status = RequestStatus.RUNNING
        bisect.insort(self.running, request, key=lambda r: r.sort_key)
        return True

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        self.running.remove(request)
        self.stats.num_preemptions += 1
        request.num_preemptions += 1
        out.preempted.append(request)
        # Anything this step already scheduled for the victim is dropped.
        out.prefills = [s for s in out.prefills if s.request is not request]
        out.decodes = [s for s in out.decodes if s.request is not request]
        mode = self.preemption_mode
        if mode == "auto":
            mode = "swap" if len(request.seqs) > 1 else "recompute"
        seq_ids = [s.seq_id for s in request.seqs]
        if mode == "swap" and self.block_manager.can_swap_out(seq_ids):
            pairs = self.block_manager.swap_out(seq_ids)
            out.blocks_to_swap_out.extend(pairs)
            self.stats.num_swapped_out_blocks += len(pairs)
            request.status = RequestStatus.SWAPPED
            bisect.insort(self.swapped, request, key=lambda r: r.sort_key)
            return
        # Recompute: drop the K/V; every live sequence re-prefills prompt + output later.
        for seq in request.seqs:
            self.free_seq(seq)
            seq.num_computed_tokens = 0
        request.status = RequestStatus.WAITING
        bisect.insort(self.waiting, request, key=lambda r: r.sort_key)
