"""StepSampler: a step's logits -> AsyncModelRunnerOutput, on the device, one copy back
(started, not waited for).

It picks the sampling parameters, token history and random stream of every sampled row from
the runner's InputBatch (token ids are read only for rows that use penalties or min_tokens),
repeats the row of a sequence that forks at this sample (n > 1) once per output index, and
hands beam-search rows back as log-probabilities. Rows under a constraint (structured
outputs) get their grammar's token bitmask first, applied on the device in one batched
operation. Under async scheduling their masks need the previous step's samples, which the
host has not seen when this step is launched: sampling is then deferred
(``AsyncModelRunnerOutput.deferred``) until the runner launches the next step, so the host
fills the masks while the device runs this step's forward pass. Seeded random streams live
here, one per (request, output index), until the request finishes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from pydaemon.core.runner_output import AsyncModelRunnerOutput, ModelRunnerOutput
from pydaemon.sampling.constraints.matchers import ConstrainedRow, GrammarMatchers
from pydaemon.sampling.sampler import Sampler
from pydaemon.sampling.sampling_metadata import SamplingMetadata, make_generator
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
    constrained: list[ConstrainedRow] = field(default_factory=list)  # structured outputs


class StepSampler:
    def __init__(self, input_batch: InputBatch, device: torch.device) -> None:
        self.input_batch = input_batch
        self.device = device
        self.sampler = Sampler()
        self._generators: dict[tuple[str, int], torch.Generator] = {}
        self._generator_indices: dict[str, list[int]] = {}  # request_id -> its indices
        # Set by the engine core with its grammar compiler on the first constrained request.
        self.grammar_matchers: GrammarMatchers | None = None

    def forget(self, request_ids: list[str]) -> None:
        if self.grammar_matchers is not None:
            self.grammar_matchers.forget(request_ids)
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
            spec = state.params.structured_outputs
            if spec is not None:  # a fork's samples share the row, hence the mask
                plan.constrained.append(ConstrainedRow(logits_row, seq_id, state.request_id, spec))
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
        last: AsyncModelRunnerOutput | None = None,
    ) -> AsyncModelRunnerOutput:
        """logits: [num_sampled_seqs, vocab] float32, one row per sequence that samples;
        last: the previous step's output (its samples are this step's placeholders).
        Nothing here waits for the device, unless a row reads token history (penalties,
        min_tokens) that holds the previous step's not-yet-copied sample."""
        batch = self.input_batch
        plan = self.plan(step, num_samples)
        out = ModelRunnerOutput(seq_ids=plan.seq_ids, beam_seq_ids=plan.beam_seq_ids)
        if plan.beam_rows:
            # Beam search reads whole rows: a second, rare device-to-host copy.
            chosen = logits[torch.tensor(plan.beam_rows, device=logits.device)]
            out.beam_logprobs = torch.log_softmax(chosen, dim=-1).cpu()
        rows, states = plan.rows, plan.states
        if not rows:
            return AsyncModelRunnerOutput(out)
        ids = [s.seq_id for s in states]
        metadata = SamplingMetadata.build(
            params=[s.params for s in states],
            prompt_token_ids=_LazyTokens(batch.prompt_token_ids, ids),
            output_token_ids=_LazyTokens(batch.output_token_ids, ids),
            generators=[self._generator(s, i) for s, i in zip(states, plan.indices, strict=True)],
            device=logits.device,
            stop_ids_for_min_tokens=[s.min_tokens_stop_ids for s in states],
        )
        matchers = self.grammar_matchers
        mask = None
        if plan.constrained:
            if matchers is None:
                raise RuntimeError("a constrained request reached the runner without its grammar")
            mask = matchers.prepare(plan.constrained)
        counts = plan.counts

        @torch.inference_mode()  # may run from get_output(), outside the runner's step
        def launch() -> tuple[torch.Tensor, torch.Tensor]:
            nonlocal logits
            if mask is not None:
                matchers.apply(logits, mask, None if last is None else _last_tokens(last))
            if rows != list(range(logits.shape[0])):
                logits = logits[torch.tensor(rows, device=logits.device)]
            return self.sampler.sample_packed(logits, metadata)

        def fill(host_rows: list[list[float]]) -> None:
            result = self.sampler.unpack(host_rows, metadata)
            start = 0
            for count in counts:
                end = start + count
                out.sampled_token_ids.append(result.sampled_token_ids[start:end])
                out.chosen_logprobs.append(result.chosen_logprobs[start:end])
                out.logprobs.append(result.logprobs[start:end])
                start = end

        if mask is not None and mask.awaiting:  # the masks wait for last's samples
            return AsyncModelRunnerOutput.deferred(out, launch, fill, plan.sample_rows, len(rows))
        sampled, packed = launch()
        # The step's one device-to-host copy, started here and waited for by get_output().
        return AsyncModelRunnerOutput(out, sampled, packed, fill, plan.sample_rows)

    def _generator(self, state: CachedSeqState, index: int) -> torch.Generator | None:
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


def _last_tokens(last: AsyncModelRunnerOutput):
    """seq_id -> the tokens ``last`` sampled for the sequence (waits for its copy)."""
    tokens: dict[int, list[int]] | None = None

    def read(seq_id: int) -> list[int]:
        nonlocal tokens
        if tokens is None:
            out = last.get_output()
            tokens = dict(zip(out.seq_ids, out.sampled_token_ids, strict=True))
        return tokens[seq_id]

    return read


class _LazyTokens(Sequence):
    """Row i: the token ids of sequence seq_ids[i], read from the input batch on demand (the
    sampler reads them only for rows with penalties or min_tokens)."""

    def __init__(self, read, seq_ids: list[int]) -> None:
        self._read, self._seq_ids = read, seq_ids

    def __len__(self) -> int:
        return len(self._seq_ids)

    def __getitem__(self, i):
        return self._read(self._seq_ids[i])
