"""A request and its sequences, as the engine core's scheduler owns them (never sent out).

A request starts with one sequence holding the prompt. With ``n > 1`` (or ``best_of``) the
prompt is prefilled once and the sequence is forked into the others at the first sample, so
that they share the prompt's KV blocks. Beam search keeps one sequence per live beam and forks
and frees them every step. A sequence's KV covers its first ``num_computed_tokens`` tokens; the
block manager holds slots for its first ``num_slots`` tokens.
"""

from __future__ import annotations

import enum
import functools
import itertools
from dataclasses import dataclass, field

from pydaemon.core.beam_search import BeamSearchState
from pydaemon.core.stop_checker import StopChecker
from pydaemon.lora_request import LoRARequest
from pydaemon.outputs import RequestMetrics
from pydaemon.sampling_params import SamplingParams

_seq_counter = itertools.count()

# Async scheduling appends this id for a token the GPU is still sampling (the next step is
# scheduled before it is known); the real id replaces it when the step's output arrives.
PLACEHOLDER_TOKEN_ID = -1


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # not admitted, or preempted by recompute (no blocks)
    RUNNING = "running"  # holds GPU blocks
    SWAPPED = "swapped"  # preempted by swap: its blocks are in the CPU pool
    FINISHED = "finished"


@dataclass
class Sequence:
    seq_id: int
    index: int  # output index in [0, best_of)
    prompt_token_ids: list[int]
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    num_slots: int = 0  # tokens that have a slot in the block manager
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # What the model runner holds of this sequence (the scheduler sends only the difference):
    is_in_runner: bool = False
    num_sent_tokens: int = 0  # token ids the runner has
    changed_block_start: int | None = None  # block_table[start:] changed since last sent
    ready_step: int = 0  # KV tiers: the first step that may read its KV (loads in flight)
    # Sliding windows: where the last scheduled step's queries started (its keys, and any
    # later step's, lie at or after that position minus the window, plus one).
    last_step_start: int = 0

    @classmethod
    def new(cls, index: int, prompt_token_ids: list[int], **kw) -> Sequence:
        return cls(seq_id=next(_seq_counter), index=index, prompt_token_ids=prompt_token_ids, **kw)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def last_token_id(self) -> int:
        return self.output_token_ids[-1] if self.output_token_ids else self.prompt_token_ids[-1]

    @property
    def has_pending_token(self) -> bool:
        """The last output token is a placeholder: sampled on the GPU, not yet seen here."""
        return bool(self.output_token_ids) and self.output_token_ids[-1] == PLACEHOLDER_TOKEN_ID

    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: set[int]
    priority: int = 0
    cache_salt: str = ""  # the prefix cache's salt (the adapter's id included)
    lora_request: LoRARequest | None = None  # None: the base model
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(arrival_time=0.0))
    status: RequestStatus = RequestStatus.WAITING
    seqs: list[Sequence] = field(default_factory=list)  # live sequences (running or swapped)
    is_forked: bool = False  # n > 1: the prompt sequence has been forked
    stop_checker: StopChecker | None = None  # token-level stops (EOS, stop ids, lengths)
    beam: BeamSearchState | None = None
    beam_pending: dict = field(default_factory=dict)  # seq_id -> logprob row awaiting its peers
    num_preemptions: int = 0
    # Prompt logprobs sent so far (prompt positions 1..this); a recomputed prefill (after a
    # preemption) repeats positions, which are not sent again.
    num_prompt_logprobs: int = 0
    order: int = field(default_factory=lambda: next(_seq_counter))

    @property
    def sort_key(self) -> tuple[int, float, int]:
        """Scheduling order: lower priority value first, then earlier arrival."""
        return (self.priority, self.metrics.arrival_time, self.order)

    @property
    def num_expected_seqs(self) -> int:
        """Sequences this request will run at once after its prompt is prefilled."""
        if self.params.is_beam_search:
            return self.params.beam_width
        return self.params.best_of or 1

    @functools.cached_property
    def has_one_seq(self) -> bool:
        """Neither n > 1 nor beam search: one sequence, one token per sample (its steps may
        run on placeholder tokens under async scheduling)."""
        return self.params.best_of == 1 and not self.params.is_beam_search

    @property
    def forks_at_first_sample(self) -> bool:
        """n > 1 (best_of): the prompt sequence forks into all of them at its first sample."""
        params = self.params
        return not self.is_forked and params.best_of > 1 and params.beam_width == 1

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED
