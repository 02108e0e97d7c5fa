"""StepSampler: a step's logits -> AsyncModelRunnerOutput, on the device, one copy back
(started, not waited for).

It picks the sampling parameters, token history and random stream of every sampled row from
the runner's InputBatch (token ids are read only for rows that use penalties or min_tokens),
repeats the row of a sequence that forks at this sample (n > 1) once per output index, and
hands beam-search rows back as log-probabilities. Rows under a constraint (structured
outputs) get the token bitmask the engine core sent for them (``GrammarOutput``, keyed by
sequence), copied to the device from pinned memory and applied in one batched operation: the
worker holds no grammar state. Seeded random streams live here, one per (request, output
index), until the request finishes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from pydaemon.core.runner_output import ModelRunnerOutput
from pydaemon.core.sched.scheduler_output import GrammarOutput
from pydaemon.sampling.bitmask import apply_grammar_bitmask
from pydaemon.sampling.sampler import Sampler
from pydaemon.sampling.sampling_metadata import SamplingMetadata, make_generator
from pydaemon.worker.async_output import AsyncModelRunnerOutput
from pydaemon.worker.input_batch import CachedSeqState, InputBatch, StepInput


@dataclass
class SamplePlan:
    """A step's samples: row i of the sampled ids is ``states[i]``'s sequence's."""

    seq_ids: list[int] = field(default_factory=list)  # sequences that sample, in order
    counts: list[int] = field(default_factory=list)  # samples of each: n at a fork, else 1
    sample_rows: dict[int, int] = field(default_factory=dict)  # seq_id -> its first sample
    rows: list[int] = field(default_factory=list)  # logits row of each sample
    states: list[CachedSeqState] = field(default_factory=list)  # of each sample
    indices: list[int] = field(default_factory=list)  # output index (random stream) of each
    beam_seq_ids: list[int] = field(default_factory=list)  # beam search: not sampled
    beam_rows: list[int] = field(default_factory=list)  # their logits rows
    logits_rows: dict[int, int] = field(default_factory=dict)  # seq_id -> its logits row


class StepSampler:
    def __init__(self, input_batch: InputBatch, device: torch.device) -> None:
        self.input_batch = input_batch
        self.device = device
        self.sampler = Sampler()
        self._generators: dict[tuple[str, int], torch.Generator] = {}
        self._generator_indices: dict[str, list[int]] = {}  # request_id -> its indices
        self._bitmask_host: torch.Tensor | None = None  # [capacity, words] int32, pinned
        self._bitmask_copied: torch.cuda.Event | None = None  # the last copy out of it

    def forget(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            for index in self._generator_indices.pop(request_id, ()):
                self._generators.pop((request_id, index), None)

    def plan(self, step: StepInput, num_samples: dict[int, int]) -> SamplePlan:
        """Which sequence each sample (and each beam row) belongs to. It reads only the step's
        inputs, the SchedulerOutput's ``num_samples`` and parameters sent with the sequences:
        every tensor-parallel rank derives the same rows."""
        batch = self.input_batch
        sampled_ids = [
            s for s, keep in zip(step.seq_ids, step.is_sampled.tolist(), strict=True) if keep
        ]
        plan = SamplePlan()
        for logits_row, seq_id in enumerate(sampled_ids):
            state = batch.seqs[seq_id]
            if state.params.is_beam_search:
                plan.beam_seq_ids.append(seq_id)
                plan.beam_rows.append(logits_row)
                continue
            count = num_samples.get(seq_id, 1)
            plan.logits_rows[seq_id] = logits_row  # a fork's samples share the row (and mask)
            plan.sample_rows[seq_id] = len(plan.rows)
            plan.seq_ids.append(seq_id)
            plan.counts.append(count)
            for k in range(count):
                plan.rows.append(logits_row)
                plan.states.append(state)
                plan.indices.append(state.index if count == 1 else k)
        return plan

    def expect(self, step: StepInput, num_samples: dict[int, int]) -> AsyncModelRunnerOutput:
        """Tensor-parallel ranks > 0: the step's output, to be filled with rank 0's samples."""
        plan = self.plan(step, num_samples)
        return AsyncModelRunnerOutput.awaiting_samples(plan.seq_ids, plan.counts, plan.sample_rows)

    def sample(
        self,
        logits: torch.Tensor,
        step: StepInput,
        num_samples: dict[int, int],
        grammar: GrammarOutput | None = None,
    ) -> AsyncModelRunnerOutput:
        """logits: [num_sampled_seqs, vocab] float32, one row per sequence that samples;
        grammar: the bitmask of the constrained ones (None: none is constrained). Nothing
        here waits for the device, unless a row reads token history (penalties, min_tokens)
        that holds the previous step's not-yet-copied sample."""
        batch = self.input_batch
        plan = self.plan(step, num_samples)
        out = ModelRunnerOutput(seq_ids=plan.seq_ids, beam_seq_ids=plan.beam_seq_ids)
        if plan.beam_rows:
            # Beam search reads whole rows: a second, rare device-to-host copy.
            chosen = logits[torch.tensor(plan.beam_rows, device=logits.device)]
            out.beam_logprobs = torch.log_softmax(chosen, dim=-1).cpu().numpy()
        rows, states = plan.rows, plan.states
        if not rows:
            return AsyncModelRunnerOutput(out)
        ids = [s.seq_id for s in states]
        metadata = SamplingMetadata.build(
            params=[s.params for s in states],
            prompt_token_ids=_LazyTokens(batch.prompt_token_ids, ids),
            output_token_ids=_LazyTokens(batch.output_token_ids, ids),
            generators=[self.generator(s, i) for s, i in zip(states, plan.indices, strict=True)],
            device=logits.device,
            stop_ids_for_min_tokens=[s.min_tokens_stop_ids for s in states],
        )
        if grammar is not None and grammar.seq_ids:
            self._apply_bitmask(logits, grammar, plan)
        if rows != list(range(logits.shape[0])):
            logits = logits[torch.tensor(rows, device=logits.device)]
        sampled, packed = self.sampler.sample_packed(logits, metadata)
        counts = plan.counts

        def fill(host_rows: list[list[float]]) -> None:
            result = self.sampler.unpack(host_rows, metadata)
            start = 0
            for count in counts:
                end = start + count
                out.sampled_token_ids.append(result.sampled_token_ids[start:end])
                out.chosen_logprobs.append(result.chosen_logprobs[start:end])
                out.logprobs.append(result.logprobs[start:end])
                start = end

        # The step's one device-to-host copy, started here and waited for by get_output().
        return AsyncModelRunnerOutput(out, sampled, packed, fill, plan.sample_rows)

    def _apply_bitmask(
        self, logits: torch.Tensor, grammar: GrammarOutput, plan: SamplePlan
    ) -> None:
        """Masks the constrained rows of logits ([num_logits_rows, vocab] float32, in place):
        one host copy into pinned memory, one copy to the device in stream order (no host
        sync), one batched masking launch. A sequence the engine sent no row for samples
        unconstrained (its request ended since the step was scheduled: its token is dropped)."""
        logits_rows = plan.logits_rows
        keep = [i for i, seq_id in enumerate(grammar.seq_ids) if seq_id in logits_rows]
        if not keep:
            return
        bitmask = grammar.bitmask if len(keep) == len(grammar.seq_ids) else grammar.bitmask[keep]
        rows = [logits_rows[grammar.seq_ids[i]] for i in keep]
        device = logits.device
        is_cuda = device.type == "cuda"
        host = self._pinned_bitmask(bitmask.shape) if is_cuda else None
        if host is not None:
            np.copyto(host.numpy(), bitmask)
            device_mask = host.to(device, non_blocking=True)
            self._bitmask_copied = torch.cuda.Event()
            self._bitmask_copied.record()
        else:
            device_mask = torch.from_numpy(np.ascontiguousarray(bitmask))
        index = None  # every row, in order: no gather
        if len(rows) != logits.shape[0] or rows != list(range(len(rows))):
            index = torch.tensor(rows, dtype=torch.int64, pin_memory=is_cuda)
            index = index.to(device, non_blocking=True)
        apply_grammar_bitmask(logits, device_mask, index)

    def _pinned_bitmask(self, shape: tuple[int, int]) -> torch.Tensor:
        """[rows, words] int32 pinned host memory, reused across steps once the previous
        step's copy out of it is done (no allocation, no page-locking per step)."""
        num_rows, num_words = shape
        host = self._bitmask_host
        if host is None or host.shape[0] < num_rows or host.shape[1] != num_words:
            capacity = max(num_rows, 2 * (0 if host is None else host.shape[0]))
            self._bitmask_host = torch.empty((capacity, num_words), dtype=torch.int32)
            self._bitmask_host = self._bitmask_host.pin_memory()
            self._bitmask_copied = None
        if self._bitmask_copied is not None:
            self._bitmask_copied.synchronize()  # normally long done: it ran before last sampling
        return self._bitmask_host[:num_rows]

    def generator(self, state: CachedSeqState, index: int) -> torch.Generator | None:
        """The seeded random stream of (request, output index), kept until the request ends."""
        params = state.params
        if params.seed is None or params.is_greedy:
            return None
        key = (state.request_id, index)
        generator = self._generators.get(key)
        if generator is None:
            generator = make_generator(params.seed, index, self.device)
            self._generators[key] = generator
            self._generator_indices.setdefault(state.request_id, []).append(index)
        return generator


class _LazyTokens(Sequence):
    """Row i: the token ids of sequence seq_ids[i], read from the input batch on demand (the
    sampler reads them only for rows with penalties or min_tokens)."""

    def __init__(self, read, seq_ids: list[int]) -> None:
        self._read, self._seq_ids = read, seq_ids

    def __len__(self) -> int:
        return len(self._seq_ids)

    def __getitem__(self, i):
        return self._read(self._seq_ids[i])
