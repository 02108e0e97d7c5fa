"""GrammarMatchers: one xgrammar matcher per constrained sequence, and a step's bitmask.

A matcher is keyed by the sequence id and follows that sequence's output tokens, whoever
wrote them: on first sight it is created from the compiled grammar and replays the tokens the
sequence already has, so a sequence forked at its first sample (n > 1), re-prefilled after a
preemption by recompute, or swapped back in needs no special case; afterwards it accepts, each
step, the tokens that arrived since. Matchers go when their request finishes (``forget``).

A step's mask is made in two halves. ``prepare`` (when the step is launched) advances each
matcher over the tokens already on the host; under async scheduling a row's last token is
then still a placeholder, the previous step's sample, which the host has not seen. ``apply``
(deferred by the StepSampler until that sample is on the host, ideally just before the next
forward is launched) accepts it, fills the bitmask and masks the logits, so the host fills
masks while the device runs the forward pass instead of the device waiting for the masks.

Per row of the step's bitmask: a running grammar's allowed tokens (filled by xgrammar's batch
matcher, threaded); a finished grammar (it accepted a stop token: EOS, which ends the
sequence with reason "stop" unless ``ignore_eos``) leaves the row unconstrained; a sequence
whose tokens the grammar rejected, or whose grammar allows no token of this vocabulary, may
only end (its stop tokens), with a warning, so that it never runs on unconstrained.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
import xgrammar as xgr

from pydaemon.sampling.constraints.bitmask import apply_grammar_bitmask
from pydaemon.sampling.constraints.compiler import GrammarCompiler
from pydaemon.sampling_params import StructuredOutputsParams

logger = logging.getLogger(__name__)


@dataclass
class ConstrainedRow:
    """A logits row of the step that samples under a constraint."""

    logits_row: int
    seq_id: int
    request_id: str
    spec: StructuredOutputsParams


@dataclass
class MaskStats:
    """Host time spent on masks, for benchmarks (the device work is a few batched ops)."""

    num_steps: int = 0
    num_rows: int = 0
    num_deferred_steps: int = 0  # masks that waited for the previous step's samples
    prepare_s: float = 0.0  # advancing matchers over the tokens on the host, at launch
    fill_s: float = 0.0  # accepting the awaited tokens and filling the bitmask
    apply_s: float = 0.0  # copying it to the device and launching the masking ops


@dataclass
class _SeqMatcher:
    matcher: xgr.GrammarMatcher
    num_accepted: int = 0  # output tokens the matcher has seen
    is_rejected: bool = False  # a token the grammar did not allow, or nothing allowed


@dataclass
class PreparedMask:
    """A step's constrained rows with their matchers, advanced over the tokens on the host.
    ``awaiting[k]``: row ``awaiting[k]``'s last output token is the previous step's sample,
    which ``GrammarMatchers.apply`` accepts first."""

    rows: list[ConstrainedRow]
    entries: list[_SeqMatcher]
    awaiting: list[int]


@dataclass
class GrammarMatchers:
    compiler: GrammarCompiler
    # (seq_id, start) -> the sequence's output token ids from ``start`` on, as the host holds
    # them: the last one may be a placeholder (negative), the previous step's sample.
    read_output_tokens: Callable[[int, int], list[int]]
    device: torch.device
    stats: MaskStats = field(default_factory=MaskStats)

    def __post_init__(self) -> None:
        self._matchers: dict[int, _SeqMatcher] = {}
        self._request_seqs: dict[str, list[int]] = {}
        self._batch = xgr.BatchGrammarMatcher()
        self._words = -(-self.compiler.vocab_size // 32)
        self._stop_only = np.zeros(self._words, dtype=np.int32)
        for t in self.compiler.stop_token_ids:
            self._stop_only[t // 32] |= np.int32(np.uint32(1 << (t % 32)).view(np.int32))
        self._host: torch.Tensor | None = None  # pinned on CUDA: [capacity, words] int32
        self._copied: torch.cuda.Event | None = None  # the last host -> device copy

    def forget(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            for seq_id in self._request_seqs.pop(request_id, ()):
                self._matchers.pop(seq_id, None)

    def apply_grammar_bitmask(self, logits: torch.Tensor, rows: list[ConstrainedRow]) -> None:
        """logits: [num_logits_rows, vocab] float32 on the device, masked in place (no row may
        await a token: ``prepare`` and ``apply`` otherwise)."""
        self.apply(logits, self.prepare(rows), None)

    def prepare(self, rows: list[ConstrainedRow]) -> PreparedMask:
        """Each row's matcher, advanced over the output tokens on the host."""
        start = time.perf_counter()
        entries: list[_SeqMatcher] = []
        awaiting: list[int] = []
        for i, row in enumerate(rows):
            entry = self._matchers.get(row.seq_id)
            if entry is None:
                entry = _SeqMatcher(xgr.GrammarMatcher(self.compiler.get(row.spec)))
                self._matchers[row.seq_id] = entry
                self._request_seqs.setdefault(row.request_id, []).append(row.seq_id)
            new_tokens = self.read_output_tokens(row.seq_id, entry.num_accepted)
            if new_tokens and new_tokens[-1] < 0:  # a placeholder: only ever the last token
                new_tokens = new_tokens[:-1]
                awaiting.append(i)
            self._accept(entry, new_tokens, row)
            entries.append(entry)
        self.stats.prepare_s += time.perf_counter() - start
        return PreparedMask(rows, entries, awaiting)

    def apply(
        self,
        logits: torch.Tensor,
        prepared: PreparedMask,
        last_tokens: Callable[[int], list[int]] | None,
    ) -> None:
        """Accepts the awaited tokens (``last_tokens(seq_id)``: what the previous step
        sampled for the sequence), fills the bitmask and masks logits ([num_logits_rows,
        vocab] float32 on the device) in place: one copy and one batched launch."""
        start = time.perf_counter()
        rows = prepared.rows
        if prepared.awaiting:
            if last_tokens is None:
                raise RuntimeError("a constrained row awaits a token and no step sampled it")
            self.stats.num_deferred_steps += 1
            for i in prepared.awaiting:
                self._accept(prepared.entries[i], last_tokens(rows[i].seq_id), rows[i])
        bitmask = self._fill(prepared)
        filled = time.perf_counter()
        is_cuda = self.device.type == "cuda"
        index = None  # every row, in order: no gather
        if len(rows) != logits.shape[0] or any(r.logits_row != i for i, r in enumerate(rows)):
            index = torch.tensor([r.logits_row for r in rows], pin_memory=is_cuda)
            index = index.to(self.device, non_blocking=True)
        device_mask = bitmask
        if is_cuda:  # from pinned memory, in stream order: no host sync
            device_mask = bitmask.to(self.device, non_blocking=True)
            self._copied = torch.cuda.Event()
            self._copied.record()
        apply_grammar_bitmask(logits, device_mask, index)
        stats = self.stats
        stats.num_steps += 1
        stats.num_rows += len(rows)
        stats.fill_s += filled - start
        stats.apply_s += time.perf_counter() - filled

    def fill_bitmask(self, rows: list[ConstrainedRow]) -> torch.Tensor:
        """-> [len(rows), ceil(vocab / 32)] int32 on the host (pinned on CUDA): row i is the
        tokens ``rows[i]``'s sequence may sample next (no row may await a token)."""
        prepared = self.prepare(rows)
        if prepared.awaiting:
            raise RuntimeError("fill_bitmask: a row's last token is still a placeholder")
        return self._fill(prepared)

    def _fill(self, prepared: PreparedMask) -> torch.Tensor:
        rows = prepared.rows
        bitmask = self._host_buffer(len(rows))
        array = bitmask.numpy()
        to_fill: list[xgr.GrammarMatcher] = []
        indices: list[int] = []
        for i, entry in enumerate(prepared.entries):
            if entry.is_rejected:
                array[i] = self._stop_only
            elif entry.matcher.is_terminated():
                array[i] = -1  # done: the row is not constrained any more
            else:
                to_fill.append(entry.matcher)
                indices.append(i)
        if to_fill:
            self._batch.batch_fill_next_token_bitmask(to_fill, array, indices)
            filled = array[: len(rows)] if len(indices) == len(rows) else array[indices]
            for k in np.flatnonzero(~filled.any(axis=1)).tolist():
                i = indices[k]
                logger.warning(
                    "request %s: its grammar allows no token of this vocabulary; it ends",
                    rows[i].request_id,
                )
                prepared.entries[i].is_rejected = True
                array[i] = self._stop_only
        return bitmask

    def _accept(self, entry: _SeqMatcher, tokens: list[int], row: ConstrainedRow) -> None:
        """Advances the matcher over the sequence's next output tokens."""
        entry.num_accepted += len(tokens)
        matcher = entry.matcher
        for token_id in tokens:
            if entry.is_rejected or matcher.is_terminated():
                break
            if not matcher.accept_token(token_id):
                logger.warning(
                    "request %s: token %d breaks its grammar; the sequence ends",
                    row.request_id,
                    token_id,
                )
                entry.is_rejected = True

    def _host_buffer(self, num_rows: int) -> torch.Tensor:
        """[num_rows, words] int32 for this step's bitmask: pinned memory reused across
        steps once the previous step's copy out of it is done (no allocation per step)."""
        pin = self.device.type == "cuda"
        if self._host is None or self._host.shape[0] < num_rows:
            capacity = max(num_rows, 2 * (0 if self._host is None else self._host.shape[0]))
            self._host = torch.empty((capacity, self._words), dtype=torch.int32, pin_memory=pin)
            self._copied = None
        if self._copied is not None:
            self._copied.synchronize()  # normally long done: the copy ran before last sampling
        return self._host[:num_rows]
