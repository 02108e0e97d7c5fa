"""The model runner's cached per-sequence state, and a step's inputs built from it.

As vLLM v1's InputBatch / CachedRequestState: the runner keeps, for every sequence it holds,
its token ids, its block table and its computed length in fixed numpy rows, updated from the
plain deltas of each ``SchedulerOutput``. A step's inputs (token ids, positions, slot
mapping, block tables) are then gathered from those rows with a few numpy operations over
the whole batch: no Python loop over tokens, and O(num_seqs) Python with small constants.
Every tensor-parallel rank holds the same state, built from the same SchedulerOutput.

Per-layer-group tables (core/kv_groups.py): a row's table interleaves the G groups' tables
(entry ``i * G + g`` is group g's block i), as the scheduler sends it; a step gets each
group's block tables and slot mapping (``StepInput.group_*``).

Async scheduling: a decode may arrive with a placeholder token (``PLACEHOLDER_TOKEN_ID``), the
token the previous step is still sampling. The step's inputs list where placeholders are (the
runner fills them on the device); the rows get the real ids once that step's output is on
the host: before any read of token history, and at the next update at the latest.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from pydaemon.core.sched.scheduler_output import SchedulerOutput
from pydaemon.lora_request import LoRARequest
from pydaemon.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pydaemon.core.runner_output import ModelRunnerOutput

_NO_IDS = np.zeros(0, dtype=np.int64)


@dataclass
class CachedSeqState:
    """Per-sequence facts that are not arrays (one Python object per live sequence)."""

    seq_id: int
    request_id: str
    index: int
    params: SamplingParams
    min_tokens_stop_ids: list[int]
    row: int
    lora_request: LoRARequest | None = None


@dataclass
class StepInput:
    """One step's model input as host arrays, in batch order (prefills first)."""

    seq_ids: list[int]
    num_prefills: int
    input_ids: np.ndarray  # [num_tokens] int64
    positions: np.ndarray  # [num_tokens] int64
    slot_mapping: np.ndarray  # [num_tokens] int64
    block_tables: np.ndarray  # [num_seqs, max_blocks] int32, padded with 0
    seq_lens: np.ndarray  # [num_seqs] int32, context length after this step
    query_lens: np.ndarray  # [num_seqs] int32
    query_start_loc: np.ndarray  # [num_seqs + 1] int32
    is_sampled: np.ndarray  # [num_seqs] bool: the step reaches the sequence's last token
    sample_index: np.ndarray  # [num_sampled] int64, token rows whose logits are sampled
    # Tokens that are placeholders (async scheduling), and their sequences; none by default.
    placeholder_index: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    placeholder_seq_ids: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    # Per-layer-group tables: [G, num_tokens] int64 and [G, num_seqs, max_blocks] int32, group
    # 0's being slot_mapping and block_tables; None with one table per sequence.
    group_slot_mapping: np.ndarray | None = None
    group_block_tables: np.ndarray | None = None


class InputBatch:
    """Rows of fixed numpy arrays, one per held sequence (grows by doubling if needed)."""

    def __init__(
        self, capacity: int, max_model_len: int, block_size: int, num_groups: int = 1
    ) -> None:
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.num_groups = num_groups
        self.max_blocks = -(-max_model_len // block_size) * num_groups  # table columns
        self.seqs: dict[int, CachedSeqState] = {}
        self._free_rows: list[int] = []
        self.capacity = 0
        self.token_ids = np.zeros((0, max_model_len), dtype=np.int32)
        self.block_table = np.zeros((0, self.max_blocks), dtype=np.int32)
        self._counters = np.zeros((4, 0), dtype=np.int32)
        self._allocate(max(1, capacity))
        # Placeholders written into rows: (seq_ids, positions, the output of the step that
        # samples them), resolved by resolve_placeholders().
        self._placeholders: list[tuple[np.ndarray, np.ndarray, Callable[[], ModelRunnerOutput]]]
        self._placeholders = []

    def _allocate(self, capacity: int) -> None:
        start = self.capacity
        self.capacity = capacity
        token_ids = np.zeros((capacity, self.max_model_len), dtype=np.int32)
        block_table = np.zeros((capacity, self.max_blocks), dtype=np.int32)
        counters = np.zeros((4, capacity), dtype=np.int32)
        token_ids[:start] = self.token_ids
        block_table[:start] = self.block_table
        counters[:, :start] = self._counters
        self.token_ids = token_ids  # [capacity, max_model_len]
        self.block_table = block_table  # [capacity, max_blocks]
        self._counters = counters
        # [capacity] each: views into one array so that growing copies one thing.
        self.num_tokens, self.num_prompt_tokens, self.num_computed_tokens, self.num_blocks = (
            counters[0],
            counters[1],
            counters[2],
            counters[3],
        )
        self._free_rows.extend(range(capacity - 1, start - 1, -1))

    # ---- state updates ----------------------------------------------------------------------
    def update(
        self,
        out: SchedulerOutput,
        last_output: Callable[[], ModelRunnerOutput] | None = None,
    ) -> None:
        """Forget finished sequences, add new ones, apply the deltas of held ones.
        ``last_output``: the previous step's output, whose samples placeholders stand for."""
        self.resolve_placeholders()  # an older step's: its output is on the host by now
        for seq_id in out.finished_seq_ids:
            state = self.seqs.pop(seq_id, None)
            if state is not None:
                self._free_rows.append(state.row)
        for new in out.scheduled_new_seqs:
            if new.seq_id in self.seqs:
                raise RuntimeError(f"sequence {new.seq_id} sent as new but already held")
            if not self._free_rows:
                self._allocate(2 * self.capacity)
            row = self._free_rows.pop()
            self.seqs[new.seq_id] = CachedSeqState(
                new.seq_id,
                new.request_id,
                new.index,
                new.params,
                new.min_tokens_stop_ids,
                row,
                new.lora_request,
            )
            n = len(new.token_ids)
            self.token_ids[row, :n] = new.token_ids
            self.num_tokens[row] = n
            self.num_prompt_tokens[row] = new.num_prompt_tokens
            self.num_computed_tokens[row] = new.num_computed_tokens
            self.block_table[row, : len(new.block_ids)] = new.block_ids
            self.num_blocks[row] = len(new.block_ids)
        cached = out.scheduled_cached_seqs
        num_cached = len(cached.seq_ids)
        if num_cached == 0:
            return
        seqs = self.seqs
        rows = np.fromiter((seqs[s].row for s in cached.seq_ids), dtype=np.int64, count=num_cached)
        self.num_computed_tokens[rows] = cached.num_computed_tokens
        new_tokens = cached.new_token_ids
        # A placeholder is only ever a decode's one new token: (seq_id, position) of each.
        placeholders: tuple[np.ndarray, np.ndarray] | None = None
        if all(len(t) == 1 for t in new_tokens):  # decodes: one token each, in one go
            ends = self.num_tokens[rows]
            values = np.fromiter((t[0] for t in new_tokens), dtype=np.int32, count=num_cached)
            self.token_ids[rows, ends] = values
            self.num_tokens[rows] = ends + 1
            is_placeholder = values < 0
            if is_placeholder.any():
                seq_ids = np.asarray(cached.seq_ids, dtype=np.int64)[is_placeholder]
                placeholders = seq_ids, ends[is_placeholder]
        else:  # prefill chunks (no new token) beside decodes
            found: list[tuple[int, int]] = []
            for seq_id, row, tokens in zip(cached.seq_ids, rows.tolist(), new_tokens, strict=True):
                n = int(self.num_tokens[row])
                self.token_ids[row, n : n + len(tokens)] = tokens
                self.num_tokens[row] = n + len(tokens)
                if tokens and tokens[-1] < 0:
                    found.append((seq_id, n + len(tokens) - 1))
            if found:
                placeholders = np.array(found, dtype=np.int64).T
        if placeholders is not None:
            if last_output is None:
                raise RuntimeError("placeholder tokens without a previous step to fill them")
            self._placeholders.append((placeholders[0], placeholders[1], last_output))
        for row, blocks in zip(rows.tolist(), cached.new_block_ids, strict=True):
            if blocks is not None:  # a new block every block_size tokens, or a copy-on-write
                start, ids = blocks
                self.block_table[row, start : start + len(ids)] = ids
                self.num_blocks[row] = start + len(ids)

    # ---- a step's inputs --------------------------------------------------------------------
    def prepare(self, out: SchedulerOutput) -> StepInput:
        """The step's inputs, vectorised over the batch (call after ``update``)."""
        seq_ids = list(out.num_scheduled_tokens)
        num_seqs = len(seq_ids)
        seqs = self.seqs
        rows = np.fromiter((seqs[s].row for s in seq_ids), dtype=np.int64, count=num_seqs)
        query_lens = np.fromiter(out.num_scheduled_tokens.values(), dtype=np.int32, count=num_seqs)
        query_start_loc = np.zeros(num_seqs + 1, dtype=np.int32)
        np.cumsum(query_lens, out=query_start_loc[1:])
        num_tokens = int(query_start_loc[-1])
        start = self.num_computed_tokens[rows]  # [num_seqs]
        # positions: start[i] + 0..query_lens[i]-1 for each sequence, without a Python loop.
        token_rows = np.repeat(rows, query_lens)  # [num_tokens]
        offsets = np.arange(num_tokens, dtype=np.int64) - np.repeat(
            query_start_loc[:-1].astype(np.int64), query_lens
        )
        positions = np.repeat(start.astype(np.int64), query_lens) + offsets
        if np.any(positions >= self.num_tokens[token_rows]):
            raise RuntimeError("SchedulerOutput schedules tokens the runner does not hold")
        input_ids = self.token_ids[token_rows, positions].astype(np.int64)
        bs, g = self.block_size, self.num_groups
        max_blocks = int(self.num_blocks[rows].max()) if num_seqs else 0
        group_slot_mapping = group_block_tables = None
        if g == 1:
            slot_mapping = (
                self.block_table[token_rows, positions // bs].astype(np.int64) * bs + positions % bs
            )
            block_tables = np.ascontiguousarray(self.block_table[rows, :max_blocks])
        else:
            columns = (positions // bs)[None, :] * g + np.arange(g)[:, None]  # [G, T]
            group_slot_mapping = (
                self.block_table[token_rows[None, :], columns].astype(np.int64) * bs
                + positions % bs
            )
            tables = self.block_table[rows, :max_blocks].reshape(num_seqs, max_blocks // g, g)
            group_block_tables = np.ascontiguousarray(tables.transpose(2, 0, 1))
            slot_mapping, block_tables = group_slot_mapping[0], group_block_tables[0]
        seq_lens = (start + query_lens).astype(np.int32)
        is_sampled = seq_lens == self.num_tokens[rows]
        sample_index = (query_start_loc[1:][is_sampled] - 1).astype(np.int64)
        placeholder_index = np.flatnonzero(input_ids < 0)
        placeholder_seq_ids = _NO_IDS
        if len(placeholder_index):
            index = np.searchsorted(query_start_loc, placeholder_index, side="right") - 1
            placeholder_seq_ids = np.asarray(seq_ids, dtype=np.int64)[index]
        return StepInput(
            seq_ids=seq_ids,
            num_prefills=out.num_prefills,
            input_ids=input_ids,
            positions=positions,
            slot_mapping=slot_mapping,
            block_tables=block_tables,
            seq_lens=seq_lens,
            query_lens=query_lens,
            query_start_loc=query_start_loc,
            is_sampled=is_sampled,
            sample_index=sample_index,
            placeholder_index=placeholder_index,
            placeholder_seq_ids=placeholder_seq_ids,
            group_slot_mapping=group_slot_mapping,
            group_block_tables=group_block_tables,
        )

    def resolve_placeholders(self) -> None:
        """Write the real ids over the placeholders (waits for their step's output)."""
        for seq_ids, positions, get_output in self._placeholders:
            out = get_output()
            index = {seq_id: i for i, seq_id in enumerate(out.seq_ids)}
            for seq_id, position in zip(seq_ids.tolist(), positions.tolist(), strict=True):
                state = self.seqs.get(seq_id)
                if state is not None:  # else forgotten since (finished, aborted)
                    self.token_ids[state.row, position] = out.sampled_token_ids[index[seq_id]][0]
        self._placeholders = []

    def output_token_ids(self, seq_id: int, start: int = 0) -> list[int]:
        """The sequence's output token ids from output index ``start`` on."""
        self.resolve_placeholders()
        row = self.seqs[seq_id].row
        first = self.num_prompt_tokens[row] + start
        return self.token_ids[row, first : self.num_tokens[row]].tolist()

    def host_output_token_ids(self, seq_id: int, start: int = 0) -> list[int]:
        """As ``output_token_ids``, without waiting: a token the last step is still sampling
        reads as its placeholder (negative; only ever the last one)."""
        row = self.seqs[seq_id].row
        first = self.num_prompt_tokens[row] + start
        return self.token_ids[row, first : self.num_tokens[row]].tolist()

    def prompt_token_ids(self, seq_id: int) -> list[int]:
        row = self.seqs[seq_id].row
        return self.token_ids[row, : self.num_prompt_tokens[row]].tolist()

    def num_output_tokens(self, seq_id: int) -> int:
        row = self.seqs[seq_id].row
        return int(self.num_tokens[row] - self.num_prompt_tokens[row])
