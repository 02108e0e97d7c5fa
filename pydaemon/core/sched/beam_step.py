"""Beam search in the engine core: one sequence per live beam, forked and freed every step.

The selection itself (transformers' semantics) is pydaemon.core.beam_search.BeamSearchState; this
module applies its decisions to sequences and KV blocks: a new beam forks its parent (sharing
every block; the first append into a shared partial block copies it on write), and the old
beams are freed, so blocks common to several beams are stored once.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from pydaemon.core.messages import SeqOutput
from pydaemon.core.request import Request, Sequence
from pydaemon.core.seq_blocks import SeqBlocks


@dataclass
class BeamStepResult:
    num_new_tokens: int = 0
    finished: list[SeqOutput] = field(default_factory=list)  # the hypotheses, best first


def advance_beams(
    blocks: SeqBlocks, request: Request, seqs: list[Sequence], logprobs: np.ndarray
) -> BeamStepResult:
    """logprobs: [len(seqs), vocab] float32 log_softmax rows of the beams run this step."""
    pending: dict[int, np.ndarray] = request.beam_pending
    for seq, row in zip(seqs, logprobs, strict=True):
        pending[seq.seq_id] = row
    live = request.seqs
    if any(s.seq_id not in pending for s in live):
        return BeamStepResult()  # some beams are still re-prefilling after a preemption
    rows = np.stack([pending.pop(s.seq_id) for s in live])
    state = request.beam
    result = state.step(rows)
    children = []
    for parent_index, token, cumulative in zip(
        result.parent_indices, result.token_ids, result.cumulative_logprobs, strict=False
    ):
        parent = live[parent_index]
        child = Sequence.new(
            len(children),
            parent.prompt_token_ids,
            output_token_ids=[*parent.output_token_ids, token],
            num_computed_tokens=parent.num_computed_tokens,
            cumulative_logprob=cumulative,
        )
        blocks.fork(parent, child)
        children.append(child)
    for seq in live:
        blocks.free(seq)
    request.seqs = children
    step = BeamStepResult(num_new_tokens=len(children))
    if not result.is_done:
        return step
    for seq in children:
        blocks.free(seq)
    request.seqs = []
    for rank, hypothesis in enumerate(state.finalize()):
        last = hypothesis.token_ids[-1] if hypothesis.token_ids else None
        step.finished.append(
            SeqOutput(
                index=rank,
                new_token_ids=list(hypothesis.token_ids),
                cumulative_logprob=hypothesis.cumulative_logprob,
                finish_reason="stop" if last in state.eos_token_ids else "length",
            )
        )
    return step
