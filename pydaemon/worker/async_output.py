"""AsyncModelRunnerOutput: a step's ModelRunnerOutput while its one device-to-host copy is
still in flight (pinned buffers and a CUDA event: device-side output handling, worker-only)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from pydaemon.core.disk_blocks import DiskTierReport
from pydaemon.core.runner_output import ModelRunnerOutput


class AsyncModelRunnerOutput:
    """A step's ModelRunnerOutput on its way to the host (vLLM v1's name).

    The device-to-host copy of the sampler's packed results starts at construction: on a GPU
    into pinned memory, non-blocking, with a CUDA event behind it, so that nothing waits for
    the step until ``get_output()`` is called (async scheduling calls it after launching the
    next step). ``sampled_token_ids`` stays on the device: the next step's input ids for
    placeholder tokens are gathered from it there, with no host round trip.
    """

    def __init__(
        self,
        output: ModelRunnerOutput,
        sampled_token_ids: torch.Tensor | None = None,
        packed: torch.Tensor | None = None,
        fill: Callable[[list[list[float]]], None] | None = None,
        sample_rows: dict[int, int] | None = None,
    ) -> None:
        """sampled_token_ids: [num_samples] int64 on the device; packed: [num_samples, cols]
        float64 on the device, which ``fill`` turns into ``output``'s token lists;
        sample_rows: seq_id -> its (first) row in both."""
        self._output = output
        self.sampled_token_ids = sampled_token_ids
        self.num_samples = 0 if sampled_token_ids is None else int(sampled_token_ids.shape[0])
        self._sample_rows = sample_rows or {}
        self._fill = fill
        self._event = None
        self._host: torch.Tensor | None = None
        if packed is not None:
            self._copy_to_host(packed)

    @classmethod
    def awaiting_samples(
        cls, seq_ids: list[int], counts: list[int], sample_rows: dict[int, int]
    ) -> AsyncModelRunnerOutput:
        """On a tensor-parallel rank > 0, which does not sample: the step's output as rank 0
        samples it (token ids only), the same rows (``StepSampler.plan``); its ids arrive by
        ``receive_sampled_token_ids`` when the next step's placeholders need them."""
        out = ModelRunnerOutput(seq_ids=list(seq_ids))

        def fill(host_rows: list[list[int]]) -> None:  # one [token_id] row per sample
            start = 0
            for count in counts:
                out.sampled_token_ids.append([row[0] for row in host_rows[start : start + count]])
                start += count

        result = cls(out, fill=fill, sample_rows=sample_rows)
        result.num_samples = sum(counts)
        return result

    def attach_prompt_logprobs(
        self, prompt_logprobs: dict[int, tuple[int, list[dict[int, float]]]]
    ) -> None:
        """The step's prompt logprobs (host data already: pydaemon/worker/prompt_logprobs.py)."""
        self._output.prompt_logprobs = prompt_logprobs

    def attach_disk_report(self, report: DiskTierReport) -> None:
        """What the step's disk reads and the writes since told (host data already)."""
        self._output.disk_report = report

    def receive_sampled_token_ids(self, sampled_token_ids: torch.Tensor) -> None:
        """sampled_token_ids: [num_samples] int64 on the device, rank 0's, just broadcast to
        this rank (``awaiting_samples``). The host copy starts now; ``get_output`` waits."""
        if tuple(sampled_token_ids.shape) != (self.num_samples,):
            raise RuntimeError(
                f"received {tuple(sampled_token_ids.shape)} sampled ids for a step that "
                f"sampled {self.num_samples}"
            )
        self.sampled_token_ids = sampled_token_ids
        self._copy_to_host(sampled_token_ids[:, None])

    def _copy_to_host(self, packed: torch.Tensor) -> None:
        """Starts copying packed ([num_samples, cols], the device) to the host, not waited for."""
        self._host = packed
        if packed.is_cuda:
            self._host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
            self._host.copy_(packed, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()

    def get_output(self) -> ModelRunnerOutput:
        """Waits for the copy (once) and returns the host output."""
        if self._host is not None:
            if self._event is not None:
                self._event.synchronize()
            self._fill(self._host.tolist())
            self._host = self._event = self._fill = None
        return self._output

    def sample_rows(self, seq_ids: Sequence[int]) -> np.ndarray:
        """[len(seq_ids)] int64: each sequence's row in ``sampled_token_ids``."""
        try:
            return np.fromiter((self._sample_rows[s] for s in seq_ids), np.int64, len(seq_ids))
        except KeyError as e:
            raise RuntimeError(
                f"sequence {e.args[0]} decodes a placeholder token but sampled nothing in the "
                "previous step"
            ) from None
