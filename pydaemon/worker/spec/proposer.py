"""The proposer interface of speculative decoding: who drafts the next tokens of a sequence.

A proposer runs in the model runner at the start of a step, before the target's forward
pass, for every decode the scheduler reserved draft slots for (``SchedulerOutput.
num_draft_tokens``). It sees each sequence's tokens (prompt + output so far, all real: steps
with speculation are synchronous) and returns at most ``max_drafts`` token ids per
sequence; the runner verifies them in the same forward (pydaemon.worker.spec_decoder).

Methods that need the GPU:

- ``draft_model`` (pydaemon/worker/draft_model.py: a second model with the same vocabulary)
  keeps its own paged KV cache under the target's block ids (same slots): ``propose`` first
  catches its cache up on the tokens it has not seen, then decodes ``max_drafts`` tokens
  greedily.
- EAGLE / EAGLE-3 heads would set ``needs_target_hidden_states`` and receive the target's
  hidden states of the verified positions in ``observe_target`` after each forward (EAGLE-3:
  three layers' states, so the model would have to return auxiliary hidden states); they
  draft from those on the next step. Not built: no EAGLE checkpoint loader (its weights
  name ``fc``/``midlayer`` tensors no pagedd model has), the model's forward does not
  return intermediate layers, and the runner does not call ``observe_target`` yet (the
  last layer's hidden states of a verify step are at hand in ``ModelRunner._forward``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class DraftRequest:
    seq_id: int
    token_ids: np.ndarray  # [num_tokens] int32: prompt + output so far (a view: do not keep)
    max_drafts: int  # slots the scheduler reserved: at most this many drafts
    block_table: np.ndarray | None = None  # [num_blocks] int32: its blocks (draft models)


class Proposer:
    """Drafts tokens for a batch of sequences. Deterministic given the tokens (a point-mass
    draft distribution), which the rejection sampler relies on."""

    needs_target_hidden_states = False

    def propose(self, requests: list[DraftRequest]) -> list[list[int]]:
        """-> one list of at most ``max_drafts`` draft ids per request."""
        raise NotImplementedError

    def forget(self, seq_ids: list[int]) -> None:  # noqa: B027 - optional hook
        """The runner dropped these sequences (finished, preempted): drop their state."""
