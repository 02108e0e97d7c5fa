"""Draft slots: the scheduler's part of speculative decoding.

After the decodes of a step have their slots, each eligible decode gets up to k more slots
past its tokens (``ScheduledSeq.num_draft_slots``), in priority order, while the token budget
and the free blocks allow: speculation never preempts, never delays a decode, and the budget
counts every draft token. The runner proposes and verifies drafts in those slots; the update
keeps the accepted ones and drops the rest (``SeqBlocks.accept_drafts``).

Eligible: a request of one sequence (not n > 1 / best_of, not beam search: their forks and
beam steps take one token per step), without a structured-output constraint (its grammar
would have to be advanced over the drafts to mask each verified row: issue 28's matcher does
not roll back yet), while at most ``disable_by_batch_size`` sequences are running (at high
batch a step is compute-bound and drafts stop paying) and the governor measures that drafts
pay at this batch size (spec_governor.py). k is capped so that the step never
emits past max_tokens or the model's length.
"""

from __future__ import annotations

from pydaemon import _core
from pydaemon.config.speculative import SpeculativeConfig
from pydaemon.core.request import Request
from pydaemon.core.runner_output import ModelRunnerOutput
from pydaemon.core.sched.spec_governor import SpecGovernor
from pydaemon.core.sched.step_plan import StepPlan
from pydaemon.core.seq_blocks import SeqBlocks
from pydaemon.core.stats import SpecDecodeStats


def allows_drafts(request: Request) -> bool:
    """Whether speculation may run for this request at all (see the module docstring)."""
    params = request.params
    return request.has_one_seq and params.structured_outputs is None


class DraftSlots:
    """Reserves draft slots for a step's decodes (see the module docstring)."""

    def __init__(self, spec: SpeculativeConfig, blocks: SeqBlocks, max_model_len: int) -> None:
        self.spec = spec
        self.blocks = blocks
        self.max_model_len = max_model_len
        self.governor = SpecGovernor(enabled=spec.auto_disable)

    def stats(self, counters: SpecDecodeStats) -> SpecDecodeStats:
        """The verify counters, with where the governor turned drafts off."""
        return counters.snapshot(self.governor.drafts_off_at())

    def is_due(self, running: list[Request], num_running_seqs: int) -> bool:
        """Whether the next step would reserve draft slots: few enough sequences run and one
        of them may speculate. Such a step is scheduled after the last one's results (async
        scheduling waits for it), and a verify step's results before the step after it."""
        return (
            num_running_seqs <= self.spec.disable_by_batch_size
            and self.governor.wants_drafts(num_running_seqs)
            and any(allows_drafts(r) for r in running)
        )

    def reserve(self, plan: StepPlan, budget: int) -> int:
        """Draft slots for the plan's decodes, in order (a step ``is_due`` chose to speculate);
        -> the budget they take."""
        spec, blocks = self.spec, self.blocks
        if budget <= 0:
            return 0
        block_size = blocks.block_size
        num_free = blocks.block_manager.num_free_blocks(_core.Device.GPU)
        used = 0
        for scheduled in plan.decodes:
            if used >= budget:
                break
            request, seq = scheduled.request, scheduled.seq
            if not allows_drafts(request):
                continue
            num_tokens = seq.num_tokens
            k = min(
                spec.num_speculative_tokens,
                budget - used,
                request.params.max_tokens - len(seq.output_token_ids) - 1,
                self.max_model_len - num_tokens - 1,
            )
            if k <= 0:
                continue
            num_held = -(-seq.num_slots // block_size)
            num_new_blocks = -(-(num_tokens + k) // block_size) - num_held
            if seq.num_slots % block_size:
                num_new_blocks += 1  # a shared last block would be copied on write
            if num_new_blocks * blocks.num_groups > num_free:  # one table per layer group
                continue
            blocks.append_draft_slots(seq, k)
            num_free = blocks.block_manager.num_free_blocks(_core.Device.GPU)
            scheduled.num_draft_slots = k
            used += k
        return used

    def record_step(
        self, plan: StepPlan, runner_output: ModelRunnerOutput, all_one_seq: bool
    ) -> None:
        """A step's result, for the governor: its kind, batch and tokens emitted. Only pure
        decode steps of requests of one sequence count (beam search and n > 1 steps are
        synchronous for their own reasons)."""
        self.governor.record(
            plan.num_running_seqs,
            plan.speculating,
            sum(len(t) for t in runner_output.sampled_token_ids),
            counts=all_one_seq and plan.is_pure_decode,
        )
