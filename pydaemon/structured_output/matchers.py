"""GrammarMatchers: one xgrammar matcher per constrained sequence, and a step's bitmask.

They live on the engine side, beside the scheduler that owns the sequences (vLLM keeps its
matchers in the scheduler process too): a step's bitmask goes down to the rank that samples
as plain data (``GrammarOutput``), whatever process or host that rank is in.

A matcher is keyed by the sequence id and follows that sequence's output tokens, whoever
wrote them: on first sight it is created from the compiled grammar and replays the tokens the
sequence already has, so a sequence forked at its first sample (n > 1), re-prefilled after a
preemption by recompute, or swapped back in needs no special case; afterwards it accepts,
each step, the tokens that arrived since. Matchers go when their request finishes
(``forget``). The engine core fills a step's bitmask once the previous step's tokens are on
the host, while the device runs this step's forward pass.

Per row of the bitmask: a running grammar's allowed tokens (filled by xgrammar's batch
matcher, threaded); a finished grammar (it accepted a stop token: EOS, which ends the
sequence with reason "stop" unless ``ignore_eos``) leaves the row unconstrained (-1); a
sequence whose tokens the grammar rejected, or whose grammar allows no token of this
vocabulary, may only end (its stop tokens), with a warning, so that it never runs on
unconstrained.

A reasoning model's grammar starts after its reasoning (``StructuredOutputsParams.
reasoning_end``): until the end marker is in the output the row is unconstrained and the
matcher reads nothing; the tokens after the marker are the grammar's input. With
``reasoning_end_text`` the marker is also found in the output's bytes, whatever pieces spell it
(as the reasoning parser finds it in the text); the rest of the token that completes it is the
grammar's first input. With
``reasoning_start`` the first row allows the grammar's tokens and the start marker's first
id: the sequence's first token decides whether it reasons first or answers at once.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import numpy as np
import xgrammar as xgr

from pydaemon.sampling_params import REASONING_END_MAX_GAP, StructuredOutputsParams
from pydaemon.structured_output.compiler import GrammarCompiler

logger = logging.getLogger(__name__)


@dataclass
class ConstrainedSeq:
    """A constrained sequence that samples this step."""

    seq_id: int
    request_id: str
    spec: StructuredOutputsParams
    output_token_ids: list[int]  # the sequence's own list (read, never written)


@dataclass
class MaskStats:
    """Host time spent on masks, for benchmarks (the device work is a few batched ops)."""

    num_steps: int = 0
    num_rows: int = 0
    fill_s: float = 0.0  # advancing the matchers and filling the bitmask


@dataclass
class _SeqMatcher:
    matcher: xgr.GrammarMatcher
    num_accepted: int = 0  # output tokens the matcher has seen
    is_rejected: bool = False  # a token the grammar did not allow, or nothing allowed
    in_reasoning: bool = False  # the reasoning has not ended: the grammar has not started
    undecided: bool = False  # no token yet; the first says whether the reasoning comes first
    searched: int = 0  # output tokens already searched for the reasoning's end
    text: bytearray = field(default_factory=bytearray)  # the reasoning's bytes, so far
    byte_ends: list[int] = field(default_factory=list)  # where each output token's bytes end


@dataclass
class GrammarMatchers:
    compiler: GrammarCompiler
    stats: MaskStats = field(default_factory=MaskStats)

    def __post_init__(self) -> None:
        self._matchers: dict[int, _SeqMatcher] = {}
        self._request_seqs: dict[str, list[int]] = {}
        self._batch = xgr.BatchGrammarMatcher()
        self.num_words = -(-self.compiler.vocab_size // 32)
        self._stop_only = np.zeros(self.num_words, dtype=np.int32)
        for t in self.compiler.stop_token_ids:
            self._stop_only[t // 32] |= np.int32(np.uint32(1 << (t % 32)).view(np.int32))
        self._buffer = np.zeros((0, self.num_words), dtype=np.int32)

    @property
    def num_matchers(self) -> int:
        return len(self._matchers)

    def forget(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            for seq_id in self._request_seqs.pop(request_id, ()):
                self._matchers.pop(seq_id, None)

    def fill_bitmask(self, rows: list[ConstrainedSeq]) -> np.ndarray:
        """-> [len(rows), ceil(vocab / 32)] int32: row i is the tokens ``rows[i]`` may sample
        next. A view of a buffer reused by the next call: copy it before then."""
        start = time.perf_counter()
        if self._buffer.shape[0] < len(rows):
            capacity = max(len(rows), 2 * self._buffer.shape[0])
            self._buffer = np.zeros((capacity, self.num_words), dtype=np.int32)
        array = self._buffer[: len(rows)]
        to_fill: list[xgr.GrammarMatcher] = []
        indices: list[int] = []
        entries: list[_SeqMatcher] = []
        for i, row in enumerate(rows):
            entry = self._advance(row)
            entries.append(entry)
            if entry.in_reasoning and not entry.undecided:
                array[i] = -1  # the reasoning is free; the grammar is for the answer
            elif entry.is_rejected:
                array[i] = self._stop_only
            elif entry.matcher.is_terminated():
                array[i] = -1  # done: the row is not constrained any more
            else:
                to_fill.append(entry.matcher)
                indices.append(i)
        if to_fill:
            self._batch.batch_fill_next_token_bitmask(to_fill, array, indices)
            filled = array if len(indices) == len(rows) else array[indices]
            for k in np.flatnonzero(~filled.any(axis=1)).tolist():
                i = indices[k]
                logger.warning(
                    "request %s: its grammar allows no token of this vocabulary; it ends",
                    rows[i].request_id,
                )
                entries[i].is_rejected = True
                array[i] = self._stop_only
            for i in indices:
                if entries[i].undecided:  # or the reasoning's start
                    t = rows[i].spec.reasoning_start[0]
                    array[i, t // 32] |= np.int32(np.uint32(1 << (t % 32)).view(np.int32))
        stats = self.stats
        stats.num_steps += 1
        stats.num_rows += len(rows)
        stats.fill_s += time.perf_counter() - start
        return array

    def _advance(self, row: ConstrainedSeq) -> _SeqMatcher:
        """The sequence's matcher, advanced over the output tokens it has not seen."""
        entry = self._matchers.get(row.seq_id)
        if entry is None:
            entry = _SeqMatcher(xgr.GrammarMatcher(self.compiler.get(row.spec)))
            entry.in_reasoning = row.spec.reasoning_end is not None
            entry.undecided = row.spec.reasoning_start is not None
            self._matchers[row.seq_id] = entry
            self._request_seqs.setdefault(row.request_id, []).append(row.seq_id)
        output = row.output_token_ids
        if output and output[-1] < 0:
            raise RuntimeError(
                f"request {row.request_id}: its bitmask was asked for before the previous "
                "step's token reached the host"
            )
        if entry.undecided:
            if not output:
                return entry
            entry.undecided = False
            entry.in_reasoning = output[0] == row.spec.reasoning_start[0]
        matcher = entry.matcher
        if entry.in_reasoning:
            start = _answer_start(output, row.spec, entry)
            rest = b""
            if row.spec.reasoning_end_text is not None and row.spec.reasoning_end_suffix is None:
                by_text = _answer_start_in_text(output, row.spec, entry, self.compiler.token_bytes)
                if by_text is not None and (start is None or by_text[0] < start):
                    start, rest = by_text
            if start is None:
                return entry
            entry.in_reasoning = False
            entry.num_accepted = start
            entry.text, entry.byte_ends = bytearray(), []
            if rest and not matcher.accept_string(bytes(rest)):
                logger.warning(
                    "request %s: the text after its reasoning breaks its grammar; the sequence "
                    "ends",
                    row.request_id,
                )
                entry.is_rejected = True
        tokens = output[entry.num_accepted :]
        entry.num_accepted += len(tokens)
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
        return entry


def _answer_start_in_text(
    output: list[int], spec: StructuredOutputsParams, entry: _SeqMatcher, token_bytes
) -> tuple[int, bytes] | None:
    """The end marker found in the output's text, however the model spelled it (' </'
    'think' '>'): -> (the first output token after the one that completes it, the bytes of
    that token after the marker: the grammar's first input), None while the reasoning goes
    on. ``entry.text`` keeps the bytes read so far, so the scan is linear over the steps."""
    marker = spec.reasoning_end_text.encode()
    text, ends = entry.text, entry.byte_ends
    searched = max(0, len(text) - len(marker) + 1)
    for token_id in output[len(ends) :]:
        text += token_bytes[token_id] if 0 <= token_id < len(token_bytes) else b""
        ends.append(len(text))
    at = text.find(marker, searched)
    if at < 0:
        return None
    end = at + len(marker)
    k = next(i for i, e in enumerate(ends) if e >= end)  # the token that completes it
    return k + 1, bytes(text[end : ends[k]])


def _answer_start(output: list[int], spec: StructuredOutputsParams, entry: _SeqMatcher):
    """Where the answer starts in ``output`` (just after the reasoning's end marker), None
    while the reasoning goes on; ``entry.searched`` keeps the scan linear over the steps."""
    end = list(spec.reasoning_end)
    suffix = list(spec.reasoning_end_suffix or ())
    for i in range(entry.searched, len(output) - len(end) + 1):
        if output[i : i + len(end)] != end:
            continue
        after = i + len(end)
        if not suffix:
            return after
        last = min(len(output) - len(suffix), after + REASONING_END_MAX_GAP)
        for j in range(after, last + 1):
            if output[j : j + len(suffix)] == suffix:
                return j + len(suffix)
        if len(output) - len(suffix) < after + REASONING_END_MAX_GAP:
            entry.searched = i  # the suffix may still come after this marker
            return None
    entry.searched = max(entry.searched, len(output) - len(end) + 1)
    return None
