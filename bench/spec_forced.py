"""Forced acceptance for bench/spec_decode.py's oracle workload (benchmark only).

With random weights the greedy reference a plain engine produces and the tokens a
speculating engine produces part after a few tokens (near-ties that the decode and the
prefill kernels round differently), so the OracleProposer stops finding its reference and
the run stops drafting: the timing then measures plain decode steps, not a perfect oracle.
Forced acceptance gives every step exactly a perfect oracle's shape instead:

- ``ForcedOracleProposer`` drafts k tokens every step: the reference's tokens at the next k
  positions of the sequence (valid ids, whether the sequence still follows its reference or
  not), padded with the sequence's last token past the reference's end;
- ``AcceptAllRejectionSampler`` runs the real verification (same device work, same host
  copy) and then marks every draft accepted, so each sequence keeps k + 1 tokens a step.

Both are installed on an in-process engine's model runner by the benchmark itself; no
configuration (``LLM`` arguments, server flags, ``speculative_config``) can select them.
"""

from __future__ import annotations

import numpy as np
import torch

from pydaemon.sampling.sampling_metadata import SamplingMetadata
from pydaemon.worker.spec_decode.proposer import DraftRequest, Proposer
from pydaemon.worker.spec_decode.rejection_sampler import RejectionSampler


class ForcedOracleProposer(Proposer):
    """Drafts ``max_drafts`` tokens for every request (see the module docstring)."""

    def __init__(self, prompts: list[list[int]], outputs: list[list[int]], max_drafts: int):
        self.prompts = [np.asarray(p, dtype=np.int64) for p in prompts]
        self.references = [np.asarray(p + o, dtype=np.int64) for p, o in zip(prompts, outputs, strict=True)]  # fmt: skip
        self.max_drafts = max_drafts
        self._reference: dict[int, int] = {}  # seq_id -> index of its prompt

    def _index_of(self, seq_id: int, tokens: np.ndarray) -> int:
        index = self._reference.get(seq_id)
        if index is None:
            index = next(
                (i for i, p in enumerate(self.prompts)
                 if len(tokens) >= len(p) and np.array_equal(tokens[: len(p)], p)),
                None,
            )  # fmt: skip
            if index is None:
                raise ValueError(f"sequence {seq_id} starts with none of the benchmark's prompts")
            self._reference[seq_id] = index
        return index

    def propose(self, requests: list[DraftRequest]) -> list[list[int]]:
        drafts = []
        for request in requests:
            tokens = request.token_ids
            n, k = len(tokens), min(request.max_drafts, self.max_drafts)
            found = self.references[self._index_of(request.seq_id, tokens)][n : n + k].tolist()
            drafts.append(found + [int(tokens[-1])] * (k - len(found)))
        return drafts

    def forget(self, seq_ids: list[int]) -> None:
        for seq_id in seq_ids:
            self._reference.pop(seq_id, None)


class AcceptAllRejectionSampler(RejectionSampler):
    """The real verification, then every draft marked accepted (column 1 of the packed rows)."""

    def verify(
        self, logits: torch.Tensor, draft_ids: torch.Tensor, metadata: SamplingMetadata
    ) -> torch.Tensor:
        packed = super().verify(logits, draft_ids, metadata)
        packed[:, 1] = (draft_ids >= 0).double()
        return packed
