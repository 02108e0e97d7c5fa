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

KV tiers (``enable_cpu_tier``, ``num_disk_blocks``): a prefix hit in the CPU or disk tier is
loaded while the step runs; the request holds its blocks and is scheduled from the step its
KV is readable (``Sequence.ready_step``: the next one, or the one after for a disk read), so
a load never stalls the batch. The step's copies go down in its ``SchedulerOutput``. A disk
read that did not deliver its block comes back in the step's ``ModelRunnerOutput.disk_report``
before its readers run: the block leaves every tier and they go back to waiting, to compute
it (never served wrong KV); with several steps in flight (pipeline parallelism) the step that
would run them waits for that report.

``schedule()`` returns a plain ``SchedulerOutput`` (pydaemon.core.sched.scheduler_output) and keeps
the live sequences it scheduled to itself; ``update_from_output()`` records what the runner
computed and sampled (``pydaemon.core.sched.seq_updates``). The scheduler builds and alone owns
the one ``_core.BlockManager``: every change goes through ``SeqBlocks``, and the engine core
reads its figures through ``make_stats()``.

Async scheduling (pydaemon/engine/async_stepper.py): ``advance()`` records a launched step as computed,
with a placeholder for each token it samples; ``schedule(overlap=True)`` then plans the next
step while that one runs, or returns None (changing nothing) when the next step might
preempt, swap, fork or run beams: those steps wait for the results first.
"""

from __future__ import annotations

import bisect
from collections import deque

from pydaemon import _core
from pydaemon.core.disk_blocks import DiskTierReport
from pydaemon.core.messages import EngineCoreOutputs
from pydaemon.core.request import Request, RequestStatus, Sequence
from pydaemon.core.runner_output import ModelRunnerOutput
from pydaemon.core.sched.lora_budget import LoRABudget
from pydaemon.core.sched.output_builder import build_scheduler_output
from pydaemon.core.sched.scheduler_config import SchedulerConfig
from pydaemon.core.sched.scheduler_output import SchedulerOutput
from pydaemon.core.sched.seq_updates import SeqUpdater
from pydaemon.core.sched.spec_slots import DraftSlots
from pydaemon.core.sched.step_plan import ScheduledSeq, StepPlan
from pydaemon.core.seq_blocks import SeqBlocks
from pydaemon.core.stats import EngineStats, SchedulerStats


class Scheduler:
    """Queues and policy. Invariants: a request is in at most one of waiting / running /
    swapped; a running request's live sequences hold GPU blocks for their first ``num_slots``
    tokens; a waiting request holds no blocks; the runner holds a sequence
    (``seq.is_in_runner``) only while it runs."""

    def __init__(self, config: SchedulerConfig) -> None:
        tiers = config.tiers
        block_size, enable_prefix_caching = config.block_size, config.enable_prefix_caching
        self.block_manager = _core.BlockManager(
            block_size,
            config.num_gpu_blocks,
            config.num_cpu_blocks,
            config.watermark,
            enable_prefix_caching,
            tiers.enable_cpu_tier,
            tiers.num_disk_blocks,
            tiers.save_ahead_blocks,
        )
        self.blocks = SeqBlocks(
            self.block_manager,
            enable_prefix_caching,
            has_tiers=tiers.enable_cpu_tier,
            kv_block_bytes=tiers.kv_block_bytes,
            kv_window=config.kv_window,
            kv_groups=config.kv_groups,
        )
        if tiers.disk_records:
            self.blocks.restore_disk_blocks(tiers.disk_records)
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.preemption_mode = config.preemption_mode
        self.loras = LoRABudget(config.max_loras)
        self.requests: dict[str, Request] = {}  # every unfinished request
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.swapped: list[Request] = []
        self.stats = SchedulerStats()
        self.finished_request_ids: list[str] = []  # told to the runner at the next step
        self.updater = SeqUpdater(self.blocks, config.max_model_len)
        speculative = config.speculative
        self.drafts = speculative and DraftSlots(speculative, self.blocks, config.max_model_len)
        # Scheduled steps awaiting update_from_output(), oldest first (two under async
        # scheduling), each with the output it was sent as.
        self._plans: deque[tuple[SchedulerOutput, StepPlan]] = deque()
        self._num_sync_only_requests = 0  # beam search or n > 1: never overlapped

    # ---- queues -----------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already running")
        self.requests[request.request_id] = request
        if not request.has_one_seq:  # beam search or n > 1: never overlapped
            self._num_sync_only_requests += 1
        request.status = RequestStatus.WAITING
        bisect.insort(self.waiting, request, key=lambda r: r.sort_key)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def can_overlap(self) -> bool:
        """Whether the next step may be scheduled while the last one runs: no beam search or
        n > 1 request (forks and beam steps need the results), no swapped request, and no
        speculation due (a verify step's accepted run decides the next step: spec_slots.py)."""
        drafting = self.drafts and self.drafts.is_due(self.running, self.num_running_seqs())
        return self._num_sync_only_requests == 0 and not self.swapped and not drafting

    def make_stats(self, num_waiting_elsewhere: int = 0) -> EngineStats:
        """The engine's figures as plain data; ``num_waiting_elsewhere``: requests the engine
        holds outside the scheduler's queues (waiting for their grammar)."""
        kv = self.blocks.kv_cache_stats()
        drafts = self.drafts
        return EngineStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting) + num_waiting_elsewhere,
            num_swapped=len(self.swapped),
            num_gpu_blocks=kv.num_gpu_blocks,
            num_free_gpu_blocks=kv.num_free_gpu_blocks,
            num_cpu_blocks=kv.num_cpu_blocks,
            num_free_cpu_blocks=kv.num_free_cpu_blocks,
            kv_waste_slots=kv.kv_waste_slots,
            num_shared_blocks=kv.num_shared_blocks,
            prefix_cache_query_tokens=kv.prefix_cache_query_tokens,
            prefix_cache_hit_tokens=kv.prefix_cache_hit_tokens,
            num_preemptions=self.stats.num_preemptions,
            num_swapped_out_blocks=self.stats.num_swapped_out_blocks,
            num_swapped_in_blocks=self.stats.num_swapped_in_blocks,
            num_prompt_tokens=self.updater.num_prompt_tokens,
            num_generation_tokens=self.updater.num_generation_tokens,
            spec_decode=drafts.stats(self.updater.spec_stats) if drafts else None,
            lora_requests=self.loras.count_by_adapter(self.running, self.waiting + self.swapped)
            if self.loras.max_loras
            else {},
            max_loras=self.loras.max_loras or 0,
            kv_tiers=kv.kv_tiers,
            num_waiting_deferred=num_waiting_elsewhere,
            iteration_tokens=self.updater.iteration_tokens.snapshot(),
        )

    def num_running_seqs(self) -> int:
        return sum(len(r.seqs) for r in self.running)

    def abort_request(self, request_id: str) -> bool:
        """Stop a request and free its KV blocks now. False if it is unknown or finished."""
        request = self.requests.get(request_id)
        if request is None:
            return False
        request.status = RequestStatus.FINISHED
        self.remove_request(request)
        return True

    def finish_seq(self, request_id: str, index: int) -> bool:
        """The front end ended sequence ``index`` (a stop string matched): free it now; the
        request ends with its last sequence. False if no such live sequence."""
        request = self.requests.get(request_id)
        seq = next((s for s in request.seqs if s.index == index), None) if request else None
        if seq is None or request.forks_at_first_sample or request.params.is_beam_search:
            return False
        self.updater.retire(request, seq)
        if not request.seqs:
            request.status = RequestStatus.FINISHED
            self.remove_request(request)
        return True

    def remove_request(self, request: Request) -> None:
        """Take a request out of every queue and free all its blocks at once."""
        if self.requests.pop(request.request_id, None) is not None and not request.has_one_seq:
            self._num_sync_only_requests -= 1
        for queue in (self.waiting, self.running, self.swapped):
            if request in queue:
                queue.remove(request)
        for seq in request.seqs:
            self.blocks.free(seq)
        self.finished_request_ids.append(request.request_id)

    # ---- the step ---------------------------------------------------------------------------
    def schedule(self, overlap: bool = False) -> SchedulerOutput | None:
        """Who runs this step, as plain data for the runner (the live plan stays here).

        ``overlap``: the previous step is still running (async scheduling). Returns None,
        having changed nothing, when this step cannot be planned without its results."""
        if overlap and not self.can_overlap():
            return None
        plan = StepPlan(step_index=self.blocks.step_index())
        if overlap and self._waits_for_disk_reads(plan.step_index):
            return None
        budget = self.max_num_batched_tokens
        # 1. Decodes of running requests, preempting from the tail when blocks run out.
        pending_prefill: set[str] = set()  # requests with work besides their decodes
        decodes = [(r, self._split_decoding(r, pending_prefill, plan)) for r in self.running]
        if not self._reserve_all_decode_slots(decodes, budget, plan):
            if overlap:
                return None  # it may preempt: after the previous step's sequences are freed
            self._reserve_decode_slots_in_order(budget, plan, pending_prefill)
        budget -= len(plan.decodes)
        plan.num_running_seqs = self.num_running_seqs()
        if self.drafts and plan.decodes and not overlap:  # 1b. Draft slots, budget allowing
            plan.speculating = self.drafts.is_due(self.running, plan.num_running_seqs)
            if plan.speculating:
                budget -= self.drafts.reserve(plan, budget)
        # 2. Prefill chunks of running requests.
        if pending_prefill:
            decoding_ids = {s.seq.seq_id for s in plan.decodes}  # a set: runs per sequence
            for request in self.running:
                if request.request_id not in pending_prefill:
                    continue
                for seq in request.seqs:
                    if budget == 0:
                        break
                    if seq.num_uncomputed_tokens == 0 or seq.seq_id in decoding_ids:
                        continue
                    if not self.blocks.is_ready(seq, plan.step_index):
                        continue  # its prefix is loading (KV tiers): a later step
                    budget -= self._schedule_prefill(request, seq, budget, plan)
        # 3. Swapped requests come back, unless this step had to preempt.
        if not plan.preempted:
            while self.swapped and budget > 0:
                request = self.swapped[0]
                if not self._swap_in(request, plan):
                    break
                if request.status != RequestStatus.RUNNING:
                    continue  # rejected
                for seq in request.seqs:
                    budget -= self._schedule_after_resume(request, seq, budget, plan)
        # 4. Admit waiting requests.
        if not plan.preempted and not self.swapped:
            num_running_seqs = self.num_running_seqs()
            while budget > 0 and (request := self.loras.first_fitting(self.waiting, self.running)):
                if num_running_seqs + request.num_expected_seqs > self.max_num_seqs:
                    break
                admitted = self._admit(request, plan)
                if admitted is None:
                    continue  # rejected: try the next one
                if not admitted:
                    break  # head of line waits for blocks
                num_running_seqs += len(request.seqs)
                for seq in request.seqs:
                    budget -= self._schedule_after_resume(request, seq, budget, plan)
        out = build_scheduler_output(plan, self.blocks, self.finished_request_ids)
        self.finished_request_ids = []
        self._plans.append((out, plan))
        return out

    def advance(self, scheduler_output: SchedulerOutput, placeholders: bool = True) -> None:
        """The step was launched: its tokens count as computed and, with ``placeholders``,
        each sequence it samples holds a placeholder token, so that the next step can be
        scheduled before its results (``update_from_output`` also does this, if not done).
        Without: a sampling sequence has nothing to schedule until then (pipeline
        parallelism's batch queue, pydaemon/engine/batch_queue.py)."""
        for out, plan in self._plans:
            if out is scheduler_output:
                self.updater.advance(plan, placeholders)
                return
        raise RuntimeError("advance: not the output of a pending schedule()")

    def discard(self, scheduler_output: SchedulerOutput) -> None:
        """The step of ``scheduler_output`` never ran (the runner failed): it is no longer
        pending, so that the steps after it can be updated, and the copies between KV tiers
        it carried are forgotten (no block keeps content that never arrived). Its requests stay
        where schedule() put them; a caller that keeps the engine aborts them."""
        self._plans = deque((out, plan) for out, plan in self._plans if out is not scheduler_output)
        if scheduler_output.has_tier_moves:
            self.blocks.discard_tier_moves(scheduler_output)

    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> EngineCoreOutputs:
        """Records what the step computed and sampled: appends tokens, checks token-level
        stops, forks, runs beam steps, frees what finished. A failure while processing one
        request fails that request alone. Steps are updated in the order they were scheduled."""
        if not self._plans or self._plans[0][0] is not scheduler_output:
            raise RuntimeError(
                "update_from_output: not the output of the oldest pending schedule()"
            )
        _, plan = self._plans.popleft()
        if runner_output.disk_report is not None:
            self._recompute_failed_disk_reads(runner_output.disk_report)
        outputs = self.updater.update(plan, runner_output)
        if self.drafts:  # how fast this kind of step was (spec_governor.py)
            self.drafts.record_step(plan, runner_output, self._num_sync_only_requests == 0)
        for request in self.updater.take_finished():
            self.remove_request(request)
        return outputs

    # ---- helpers ----------------------------------------------------------------------------
    def _recompute_failed_disk_reads(self, report: DiskTierReport) -> None:
        """A step's disk reads that did not deliver their blocks: the blocks leave every tier
        and the requests holding one (admitted, never run since: a read's block is readable two
        steps later) go back to the waiting queue with nothing computed. Readmitted, they find
        their prefix up to that block and compute the rest."""
        seq_ids = self.blocks.apply_disk_report(report)
        if not seq_ids:
            return
        for request in [r for r in self.running if any(s.seq_id in seq_ids for s in r.seqs)]:
            self.running.remove(request)
            for seq in request.seqs:
                self.blocks.free(seq)
                seq.num_computed_tokens = 0
            request.status = RequestStatus.WAITING
            bisect.insort(self.waiting, request, key=lambda r: r.sort_key)

    def _waits_for_disk_reads(self, step_index: int) -> bool:
        """Whether a step in flight read from disk blocks that step ``step_index`` may read:
        its report must come first (pipeline parallelism keeps several steps in flight)."""
        return any(
            out.blocks_to_read_from_disk and plan.step_index + 2 <= step_index
            for out, plan in self._plans
        )

    def _split_decoding(
        self, request: Request, pending_prefill: set[str], plan: StepPlan
    ) -> list[Sequence]:
        """The request's sequences that decode one token now; notes whether it has more. A
        sequence whose prefix is still loading (KV tiers) does neither this step."""
        decoding = []
        step_index = plan.step_index
        for seq in request.seqs:
            if seq.ready_step > step_index:  # inline: this loop runs per sequence, every step
                continue
            num_uncomputed = seq.num_tokens - seq.num_computed_tokens
            if num_uncomputed == 1 and seq.output_token_ids:
                decoding.append(seq)
            elif num_uncomputed:
                pending_prefill.add(request.request_id)
        return decoding

    def _reserve_all_decode_slots(
        self, decodes: list[tuple[Request, list[Sequence]]], budget: int, plan: StepPlan
    ) -> bool:
        """The common case in one check: every decode fits the budget and the free blocks.
        False (nothing done) when some request must wait or be preempted."""
        num_decodes = sum(len(d) for _, d in decodes)
        if num_decodes > budget:
            return False
        needing = [s for _, d in decodes for s in d if s.num_slots < s.num_tokens]
        if not self.blocks.can_append_slots(needing):
            return False
        for seq in needing:
            self.blocks.append_slot(seq)
        plan.decodes.extend(ScheduledSeq(r, s, 1) for r, d in decodes for s in d)
        return True

    def _reserve_decode_slots_in_order(
        self, budget: int, plan: StepPlan, pending_prefill: set[str]
    ) -> None:
        """Request by request in priority order, preempting from the tail when blocks run out."""
        index = 0
        while index < len(self.running):
            request = self.running[index]
            decoding = self._split_decoding(request, pending_prefill, plan)
            if not decoding:
                index += 1
                continue
            if len(decoding) > budget:
                pending_prefill.add(request.request_id)  # what budget is left may take some
                index += 1  # it keeps its blocks and runs next step
                continue
            if not self._reserve_decode_slots(request, decoding, plan):
                continue  # preempted itself: running[index] is now the next request
            plan.decodes.extend(ScheduledSeq(request, seq, 1) for seq in decoding)
            budget -= len(decoding)
            index += 1

    def _reserve_decode_slots(
        self, request: Request, decoding: list[Sequence], plan: StepPlan
    ) -> bool:
        """Give each decoding sequence a slot for its last token, preempting if needed."""
        needing = [s for s in decoding if s.num_slots < s.num_tokens]
        while not self.blocks.can_append_slots(needing):
            victim = self.running[-1]
            self._preempt(victim, plan)
            if victim is request:
                return False
        for seq in needing:
            self.blocks.append_slot(seq)
        return True

    def _schedule_prefill(
        self, request: Request, seq: Sequence, budget: int, plan: StepPlan
    ) -> int:
        num_new = min(seq.num_uncomputed_tokens, budget)
        if num_new <= 0:
            return 0
        plan.prefills.append(ScheduledSeq(request, seq, num_new))
        return num_new

    def _schedule_after_resume(
        self, request: Request, seq: Sequence, budget: int, plan: StepPlan
    ) -> int:
        """Schedule a sequence that just got its blocks (admitted or swapped in); one whose
        prefix is loading from a lower tier waits for a later step."""
        if not self.blocks.is_ready(seq, plan.step_index):
            return 0
        if seq.num_slots < seq.num_tokens:  # swapped in while decoding: needs one more slot
            if not self.blocks.can_append_slots([seq]):
                return 0
            self.blocks.append_slot(seq)
        return self._schedule_prefill(request, seq, budget, plan)

    def _admit(self, request: Request, plan: StepPlan) -> bool | None:
        """Allocate blocks for a waiting request. True: admitted; False: later; None: rejected."""
        statuses = [self.blocks.can_allocate(s, request.cache_salt) for s in request.seqs]
        if _core.AllocStatus.NEVER in statuses:
            self.waiting.remove(request)
            plan.reject_too_big(request)
            return None
        if _core.AllocStatus.LATER in statuses:
            return False
        allocated: list[Sequence] = []
        try:
            for seq in request.seqs:
                num_cached = self.blocks.allocate(seq, request.cache_salt)
                allocated.append(seq)
                # The last token is always computed so that the step yields its logits.
                seq.num_computed_tokens = min(num_cached, seq.num_tokens - 1)
                if seq is request.seqs[0] and request.metrics.first_scheduled_time is None:
                    request.metrics.num_cached_tokens = seq.num_computed_tokens
        except _core.NoFreeBlocksError:
            for seq in allocated:
                self.blocks.free(seq)
            return False
        self.waiting.remove(request)
        request.status = RequestStatus.RUNNING
        bisect.insort(self.running, request, key=lambda r: r.sort_key)
        return True

    def _swap_in(self, request: Request, plan: StepPlan) -> bool:
        status = self.blocks.can_swap_in(request.seqs)
        if status == _core.AllocStatus.NEVER:
            self.swapped.pop(0)
            plan.reject_too_big(request)
            return True
        if status != _core.AllocStatus.OK:
            return False
        if self.num_running_seqs() + len(request.seqs) > self.max_num_seqs:
            return False
        if not self.loras.fits(request, self.running):
            return False
        pairs = self.blocks.swap_in(request.seqs)
        plan.blocks_to_swap_in.extend(pairs)
        self.stats.num_swapped_in_blocks += len(pairs)
        self.swapped.pop(0)
        request.status = RequestStatus.RUNNING
        bisect.insort(self.running, request, key=lambda r: r.sort_key)
        return True

    def _preempt(self, request: Request, plan: StepPlan) -> None:
        self.running.remove(request)
        self.stats.num_preemptions += 1
        request.num_preemptions += 1
        plan.preempted.append(request)
        # Anything this step already scheduled for the victim is dropped.
        plan.prefills = [s for s in plan.prefills if s.request is not request]
        plan.decodes = [s for s in plan.decodes if s.request is not request]
        mode = self.preemption_mode
        if mode == "auto":
            mode = "swap" if len(request.seqs) > 1 else "recompute"
        if mode == "swap" and self.blocks.can_swap_out(request.seqs):
            pairs = self.blocks.swap_out(request.seqs)
            plan.blocks_to_swap_out.extend(pairs)
            self.stats.num_swapped_out_blocks += len(pairs)
            request.status = RequestStatus.SWAPPED
            bisect.insort(self.swapped, request, key=lambda r: r.sort_key)
            return
        # Recompute: drop the K/V; every live sequence re-prefills prompt + output later.
        for seq in request.seqs:
            self.blocks.free(seq)
            seq.num_computed_tokens = 0
        request.status = RequestStatus.WAITING
        bisect.insort(self.waiting, request, key=lambda r: r.sort_key)
