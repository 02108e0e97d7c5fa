"""OracleProposer: drafts known continuations (tests and benchmarks only; no config selects it).

Given the full token sequences greedy decoding produces (prompt + output), it drafts for a
sequence the next tokens of the reference that its tokens are a prefix of: the mechanism's
ceiling (every draft accepted) for bench/spec_decode.py. ``corrupt_every`` replaces every
n-th draft by another id, so tests see rejections at known places.
"""

from __future__ import annotations

import numpy as np

from pydaemon.worker.spec_decode.proposer import DraftRequest, Proposer


class OracleProposer(Proposer):
    def __init__(
        self,
        references: list[list[int]],
        corrupt_every: int = 0,
        vocab_size: int = 256,
        max_drafts: int | None = None,
    ) -> None:
        self.vocab_size = vocab_size
        self.max_drafts = max_drafts  # at most this many per step (below the slots reserved)
        self.references = [np.asarray(r, dtype=np.int64) for r in references]
        self.corrupt_every = corrupt_every
        self.num_proposed = 0
        self._matched: dict[int, int] = {}  # seq_id -> index of its reference

    def _reference_of(self, seq_id: int, tokens: np.ndarray) -> np.ndarray | None:
        """The reference ``tokens`` is a prefix of: the one this sequence matched before if
        it still does (its last 16 tokens checked: cheap at batch 64), else a full search."""
        n = len(tokens)
        index = self._matched.get(seq_id)
        if index is not None:
            ref = self.references[index]
            if len(ref) > n and np.array_equal(ref[max(0, n - 16) : n], tokens[-16:]):
                return ref
        for index, ref in enumerate(self.references):
            if len(ref) > n and np.array_equal(ref[:n], tokens):
                self._matched[seq_id] = index
                return ref
        return None

    def propose(self, requests: list[DraftRequest]) -> list[list[int]]:
        drafts = []
        for request in requests:
            tokens = request.token_ids
            n = len(tokens)
            found: list[int] = []
            k = min(request.max_drafts, self.max_drafts or request.max_drafts)
            ref = self._reference_of(request.seq_id, tokens)
            if ref is not None:
                found = ref[n : n + k].tolist()
            if self.corrupt_every:
                for j in range(len(found)):
                    self.num_proposed += 1
                    if self.num_proposed % self.corrupt_every == 0:
                        found[j] = (found[j] + 1) % self.vocab_size
            drafts.append(found)
        return drafts
