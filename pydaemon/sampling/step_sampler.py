"""StepSampler: a step's logits -> AsyncModelRunnerOutput, on the device, one copy back
(started, not waited for).

It picks the sampling parameters, token history and random stream of every sampled row from
the runner's InputBatch (token ids are read only for rows that use penalties or min_tokens),
repeats the row of a sequence that forks at this sample (n > 1) once per output index, and
hands beam-search rows back as log-probabilities. Seeded random streams live here, one per
(request, output index), until the request finishes.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pydaemon.input_batch import CachedSeqState, InputBatch, StepInput
from pydaemon.runner_output import AsyncModelRunnerOutput, ModelRunnerOutput
from pydaemon.sampling.sampler import Sampler
from pydaemon.sampling.sampling_metadata import SamplingMetadata, make_generator


class StepSampler:
    def __init__(self, input_batch: InputBatch, device: torch.device) -> None:
        self.input_batch = input_batch
        self.device = device
        self.sampler = Sampler()
        self._generators: dict[tuple[str, int], torch.Generator] = {}
        self._generator_indices: dict[str, list[int]] = {}  # request_id -> its indices

    def forget(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            for index in self._generator_indices.pop(request_id, ()):
                self._generators.pop((request_id, index), None)

    def sample(
        self, logits: torch.Tensor, step: StepInput, num_samples: dict[int, int]
    ) -> AsyncModelRunnerOutput:
        """logits: [num_sampled_seqs, vocab] float32, one row per sequence that samples.
        Nothing here waits for the device, unless a row reads token history (penalties,
        min_tokens) that holds the previous step's not-yet-copied sample."""
        batch = self.input_batch
        sampled_ids = [
            s for s, keep in zip(step.seq_ids, step.is_sampled.tolist(), strict=True) if keep
        ]
        out = ModelRunnerOutput()
        beam_rows: list[int] = []
        rows: list[int] = []  # logits row of each sample (repeated for a fork)
        states: list[CachedSeqState] = []
        indices: list[int] = []
        for logits_row, seq_id in enumerate(sampled_ids):
            state = batch.seqs[seq_id]
            if state.params.is_beam_search:
                out.beam_seq_ids.append(seq_id)
                beam_rows.append(logits_row)
                continue
            out.seq_ids.append(seq_id)
            count = num_samples.get(seq_id, 1)
            for k in range(count):
                rows.append(logits_row)
                states.append(state)
                indices.append(state.index if count == 1 else k)
        if beam_rows:
            # Beam search reads whole rows: a second, rare device-to-host copy.
            chosen = logits[torch.tensor(beam_rows, device=logits.device)]
            out.beam_logprobs = torch.log_softmax(chosen, dim=-1).cpu()
        if not rows:
            return AsyncModelRunnerOutput(out)
        if rows != list(range(logits.shape[0])):
            logits = logits[torch.tensor(rows, device=logits.device)]
        ids = [s.seq_id for s in states]
        metadata = SamplingMetadata.build(
            params=[s.params for s in states],
            prompt_token_ids=_LazyTokens(batch.prompt_token_ids, ids),
            output_token_ids=_LazyTokens(batch.output_token_ids, ids),
            generators=[self._generator(s, i) for s, i in zip(states, indices, strict=True)],
            device=logits.device,
            stop_ids_for_min_tokens=[s.min_tokens_stop_ids for s in states],
        )
        sampled, packed = self.sampler.sample_packed(logits, metadata)
        counts = [num_samples.get(seq_id, 1) for seq_id in out.seq_ids]
        sample_rows: dict[int, int] = {}
        cursor = 0
        for seq_id, count in zip(out.seq_ids, counts, strict=True):
            sample_rows[seq_id] = cursor
            cursor += count

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
        return AsyncModelRunnerOutput(out, sampled, packed, fill, sample_rows)

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


class _LazyTokens(Sequence):
    """Row i: the token ids of sequence seq_ids[i], read from the input batch on demand (the
    sampler reads them only for rows with penalties or min_tokens)."""

    def __init__(self, read, seq_ids: list[int]) -> None:
        self._read, self._seq_ids = read, seq_ids

    def __len__(self) -> int:
        return len(self._seq_ids)

    def __getitem__(self, i):
        return self._read(self._seq_ids[i])
