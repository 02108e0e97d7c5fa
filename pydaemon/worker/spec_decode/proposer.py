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
- ``eagle`` (pydaemon/worker/eagle_proposer.py: an EAGLE-1 head, pydaemon/models/eagle.py)
  sets ``needs_target_hidden_states``: after every target forward (prefill chunks, decodes,
  verify steps) the runner hands it the step's hidden states in ``observe_target``
  (``TargetStep``: only the rows whose token was real, so a verify step's rejected rows are
  dropped), from which the head extends its own paged KV cache (same block ids and slots as
  the target's); ``propose`` then drafts from the last one.
- ``eagle3`` is not built. An EAGLE-3 head reads three target layers' hidden states (vLLM:
  the residual streams entering layers 2, L/2 and L-3, before their norms, concatenated:
  fc over 3 * hidden), so LlamaModel.forward would have to return those auxiliary states
  (and the CUDA graphs capture them); its one layer ("midlayer") attends over
  cat(input_layernorm(embed), hidden_norm(fc output)) = 2 * hidden (a qkv_proj of 2 * hidden
  inputs, the residual being the fc output), it has its own final norm and an LM head over a
  smaller draft vocabulary whose ids map to the target's through ``d2t`` (target id = draft
  id + d2t[draft id]); drafting chains the pre-norm output as the next hidden state. The
  loader (``midlayer.*`` names, ``d2t``/``t2d`` buffers) and that layer are what is missing.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from pydaemon.sampling_params import SamplingParams


@dataclass
class DraftRequest:
    seq_id: int
    token_ids: np.ndarray  # [num_tokens] int32: prompt + output so far (a view: do not keep)
    max_drafts: int  # slots the scheduler reserved: at most this many drafts
    block_table: np.ndarray | None = None  # [num_blocks] int32: its blocks (draft models)
    # What the target's verification applies to its logits before the argmax (min_tokens
    # mask, logit bias, penalties), for proposers that draft from logits (draft models):
    # the request's parameters, token_ids[:num_prompt_tokens] is its prompt, and the ids
    # min_tokens holds back. None: no processors.
    params: SamplingParams | None = None
    num_prompt_tokens: int = 0
    min_tokens_stop_ids: list[int] = field(default_factory=list)


@dataclass
class TargetStep:
    """What one target forward computed, for proposers that read its hidden states. Rows are
    the step's tokens in batch order; a sequence's rows start at ``query_start_loc[i]``."""

    seq_ids: list[int]
    starts: np.ndarray  # [num_seqs] int64: position of each sequence's first row
    query_start_loc: np.ndarray  # [num_seqs + 1] int32
    num_valid: np.ndarray  # [num_seqs] int32: its leading rows whose token is real (a verify
    # step: the accepted drafts and the row before them)
    block_tables: np.ndarray  # [num_seqs, max_blocks] int32
    input_ids: torch.Tensor  # [>= num_tokens] int64 on the device (async placeholders filled)
    hidden_states: torch.Tensor  # [>= num_tokens, hidden_size]: the LM head's input


class Proposer:
    """Drafts tokens for a batch of sequences. Deterministic given the tokens (a point-mass
    draft distribution), which the rejection sampler relies on."""

    needs_target_hidden_states = False

    def propose(self, requests: list[DraftRequest]) -> list[list[int]]:
        """-> one list of at most ``max_drafts`` draft ids per request."""
        raise NotImplementedError

    def observe_target(self, step: TargetStep) -> None:  # noqa: B027 - optional hook
        """After each target forward, when ``needs_target_hidden_states``."""

    def forget(self, seq_ids: list[int]) -> None:  # noqa: B027 - optional hook
        """The runner dropped these sequences (finished, preempted): drop their state."""
