"""StepPlan: the step being scheduled, with live objects. It never leaves the scheduler;
``SchedulerOutput`` is its plain form for the model runner."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from pydaemon.core.request import Request, Sequence


@dataclass
class ScheduledSeq:
    request: Request
    seq: Sequence
    num_new_tokens: int  # tokens whose K/V this step computes
    num_draft_slots: int = 0  # speculative decoding: draft slots reserved past the tokens


@dataclass
class StepPlan:
    prefills: list[ScheduledSeq] = field(default_factory=list)  # query_len >= 1, first
    decodes: list[ScheduledSeq] = field(default_factory=list)  # query_len == 1
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)  # (gpu, cpu)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)  # (cpu, gpu)
    preempted: list[Request] = field(default_factory=list)
    rejected: list[tuple[Request, str]] = field(default_factory=list)  # can never run
    is_advanced: bool = False  # its tokens count as computed (SeqUpdater.advance)
    by_seq_id: dict[int, ScheduledSeq] = field(default_factory=dict)  # set by advance
    speculating: bool = False  # planned with draft slots due (spec_slots.py, spec_governor.py)
    num_running_seqs: int = 0  # when planned
    step_index: int = 0  # the block manager's step (KV tiers: which loads are readable)
    # When the plan was made: a request's first_scheduled_time (its queue time ends here, not
    # after the step's compute, which a synchronous step's advance comes after).
    scheduled_time: float = field(default_factory=time.monotonic)

    @property
    def is_pure_decode(self) -> bool:
        """Decodes alone: no prefill, preemption or swap (spec_governor.py's steps)."""
        return bool(self.decodes) and not (
            self.prefills or self.preempted or self.blocks_to_swap_in or self.blocks_to_swap_out
        )

    def reject_too_big(self, request: Request) -> None:
        """The request needs more KV blocks than the whole cache has: it can never run."""
        num_tokens = max(s.num_tokens for s in request.seqs)
        reason = (
            f"request {request.request_id!r} needs more KV blocks than the cache has "
            f"({num_tokens} tokens in {len(request.seqs)} sequence(s))"
        )
        self.rejected.append((request, reason))

    @property
    def scheduled(self) -> list[ScheduledSeq]:
        return self.prefills + self.decodes

    @property
    def num_seqs(self) -> int:
        return len(self.prefills) + len(self.decodes)
