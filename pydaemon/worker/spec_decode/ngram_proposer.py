"""NgramProposer: prompt-lookup drafts (vLLM's ``ngram`` method), on the host, with numpy.

For each sequence it looks for the longest suffix of its tokens (prompt + output so far), of
``prompt_lookup_min`` to ``prompt_lookup_max`` tokens, that also occurs earlier in those
tokens, and drafts the (at most ``k``) tokens that followed that earlier occurrence. Among
earlier occurrences of the same length the most recent one wins (copy-heavy text repeats
its latest context). No match: no drafts. Cost: one vectorised scan per n-gram length over
the sequence's tokens (sliding-window compare), no Python loop over positions.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from pydaemon.worker.spec_decode.proposer import DraftRequest, Proposer


def find_ngram_drafts(tokens: np.ndarray, min_n: int, max_n: int, k: int) -> np.ndarray:
    """tokens: [num_tokens] int; -> [<= k] int64, the drafts (empty without a match)."""
    num_tokens = len(tokens)
    for n in range(min(max_n, num_tokens - 1), min_n - 1, -1):
        suffix = tokens[num_tokens - n :]
        # Windows starting at 0 .. num_tokens - n - 1: every earlier occurrence (the suffix
        # itself, at num_tokens - n, is left out).
        windows = sliding_window_view(tokens[: num_tokens - 1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if len(hits):
            start = int(hits[-1]) + n
            return tokens[start : start + k].astype(np.int64)
    return np.zeros(0, dtype=np.int64)


class NgramProposer(Proposer):
    """vLLM's ``ngram`` method (module docstring)."""

    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int, prompt_lookup_max: int):
        self.k = num_speculative_tokens
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max

    def propose(self, requests: list[DraftRequest]) -> list[list[int]]:
        return [
            find_ngram_drafts(r.token_ids, self.min_n, self.max_n, r.max_drafts).tolist()
            for r in requests
        ]
