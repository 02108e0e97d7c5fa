"""Beam search in the engine: one sequence per live beam, forked and freed every step.

The selection itself (transformers' semantics) is pydaemon.beam_search.BeamSearchState; this
module applies its decisions to sequences and KV blocks: a new beam forks its parent (sharing
every block; the first append into a shared partial block copies it on write), and the old
beams are freed, so blocks common to several beams are stored once.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from pydaemon.request import Request, Sequence

if TYPE_CHECKING:
    from pydaemon.engine import LLMEngine


def advance_beams(
    engine: LLMEngine, request: Request, seqs: list[Sequence], logprobs: torch.Tensor
) -> None:
    """logprobs: [len(seqs), vocab] float32 log_softmax rows of the beams sampled this step."""
    pending: dict[int, torch.Tensor] = request.beam_pending
    for seq, row in zip(seqs, logprobs, strict=True):
        pending[seq.seq_id] = row
    live = request.seqs
    if any(s.seq_id not in pending for s in live):
        return  # some beams are still re-prefilling after a recompute preemption
    rows = torch.stack([pending.pop(s.seq_id) for s in live])
    state = request.beam
    result = state.step(rows)
    children = []
    for parent_index, token, cumulative in zip(
        result.parent_indices, result.token_ids, result.cumulative_logprobs, strict=False
    ):
        parent = live[parent_index]
        child = engine._fork(request, parent, len(children), register=False)
        child.output_token_ids.append(token)
        child.cumulative_logprob = cumulative
        children.append(child)
    for seq in live:
        engine.scheduler.free_seq(seq)
    request.seqs = children
    engine.num_generation_tokens += len(children)
    if not result.is_done:
        return
    for seq in children:
        engine.scheduler.free_seq(seq)
    request.seqs = []
    for rank, hypothesis in enumerate(state.finalize()):
        seq = Sequence.new(rank, request.prompt_token_ids, output_token_ids=hypothesis.token_ids)
        seq.cumulative_logprob = hypothesis.cumulative_logprob
        last = hypothesis.token_ids[-1] if hypothesis.token_ids else None
        reason = "stop" if last in state.eos_token_ids else "length"
        engine.output_processor.finish_beam_seq(seq, reason)
        request.finished_seqs.append(seq)
