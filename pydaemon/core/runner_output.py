"""ModelRunnerOutput: what one step sampled, as plain host data (one device-to-host copy).

The rank that samples builds it (pydaemon/worker/async_output.py holds it while the copy is in
flight); the scheduler reads it in ``update_from_output``. Plain data: lists and numpy.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from pydaemon.core.disk_blocks import DiskTierReport
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
    # Beam search sequences are not sampled: their log_softmax rows go to the scheduler's
    # beam step.
    beam_seq_ids: list[int] = field(default_factory=list)
    beam_logprobs: np.ndarray | None = None  # [len(beam_seq_ids), vocab] float32
    # Speculative decoding: seq_id -> drafts it verified this step; its sampled_token_ids
    # entry is then the accepted drafts and one sampled token (not n samples of a fork).
    num_draft_tokens: dict[int, int] = field(default_factory=dict)
    # Prompt logprobs (SamplingParams.prompt_logprobs): seq_id -> (position of the first
    # prompt token covered, {token_id: logprob} of each following prompt token and its top-k),
    # for the prefill chunks of this step.
    prompt_logprobs: dict[int, tuple[int, list[TokenLogprobs]]] = field(default_factory=dict)
    # The disk tier (KV tiers): this step's failed reads, failed writes; None: nothing to say.
    disk_report: DiskTierReport | None = None
