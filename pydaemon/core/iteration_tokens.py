"""Tokens per engine step, as a histogram (vLLM's ``vllm:iteration_tokens_total``): each
updated step observes the prompt tokens it computed (prefill chunks; prefix-cache hits are
not computed) plus the tokens it generated. Kept by the engine core, shipped in EngineStats
as cumulative bucket counts."""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

# vLLM's buckets for vllm:iteration_tokens_total
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


@dataclass
class IterationTokens:
    """``counts[i]``: steps of at most ``ITERATION_TOKENS_BUCKETS[i]`` tokens and more than the
    bucket before (not cumulative); the last: more than the largest bucket."""

    counts: list[int] = field(default_factory=lambda: [0] * (len(ITERATION_TOKENS_BUCKETS) + 1))
    sum: int = 0

    def observe(self, num_tokens: int) -> None:
        self.counts[bisect.bisect_left(ITERATION_TOKENS_BUCKETS, num_tokens)] += 1
        self.sum += num_tokens

    @property
    def count(self) -> int:
        return sum(self.counts)

    def snapshot(self) -> IterationTokens:
        return IterationTokens(list(self.counts), self.sum)

    def minus(self, before: IterationTokens | None) -> IterationTokens:
        """The steps since ``before`` (a snapshot of this histogram, or None: all)."""
        if before is None:
            return self.snapshot()
        return IterationTokens(
            [n - b for n, b in zip(self.counts, before.counts, strict=True)], self.sum - before.sum
        )
