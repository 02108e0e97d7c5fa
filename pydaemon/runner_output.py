"""ModelRunnerOutput: what one step sampled, as plain host data (one device-to-host copy)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pydaemon.outputs import TokenLogprobs


@dataclass
class ModelRunnerOutput:
    """Entry i belongs to sequence ``seq_ids[i]``, a sequence that sampled this step.

    A sequence that forks at this sample (``SchedulerOutput.num_samples``) has one token per
    output index in ``sampled_token_ids[i]``; every other sequence has exactly one.
    """

    seq_ids: list[int] = field(default_factory=list)
    sampled_token_ids: list[list[int]] = field(default_factory=list)
    chosen_logprobs: list[list[float]] = field(default_factory=list)  # raw-logits logprob
    logprobs: list[list[TokenLogprobs | None]] = field(default_factory=list)  # top-k asks
    # Beam search sequences are not sampled: their log_softmax rows, [vocab] float32 on the
    # CPU each, go to the scheduler's beam step.
    beam_seq_ids: list[int] = field(default_factory=list)
    beam_logprobs: torch.Tensor | None = None  # [len(beam_seq_ids), vocab] float32, CPU


EMPTY_RUNNER_OUTPUT = ModelRunnerOutput()
