"""SpecGovernor: speculative decoding turns itself off where it measures slower than plain
decoding, and back on where it pays again.

Whether drafts pay depends on the model, the GPU, the batch and the text: on an H200 n-gram
drafts on SmolLM2-135M ran 1.6x faster than plain decoding at batch 1 and 0.47x at batch 8-32
(2026-12-02, bench/spec_decode.py: a verify step is synchronous, plain steps overlap the host
with the GPU, and on a small model the host is most of a step). A fixed
``disable_by_batch_size`` cannot know that, so the governor measures it while serving.

Per batch-size bucket (1, 2-3, 4-7, 8-15, ...: the running sequences' count, bit length), it
keeps the output tokens per second of steps of either kind, an exponential moving average of
(tokens the step emitted) / (time since the previous step's update). Only pure decode steps
count (a step with prefill tokens, a swap, a beam or n > 1 request weighs differently), and
only an interval between two counted steps of the same kind and bucket (the first step after a
switch drains or refills the async pipeline; a pause between bursts is not a step).

A bucket starts speculating. After ``first_probe`` speculating steps it runs ``probe_len``
plain steps, then keeps the kind with the higher rate. When a probe confirms the kind it left,
the next probe comes twice as late (up to ``max_probe_every`` steps); when the kind changes,
probes come every ``first_probe`` steps again. A probe costs a few steps of the slower kind:
at worst ``probe_len / probe_every`` of a bucket's steps.

The decision is a pure function of the governor's state, which changes only in ``record``:
``DraftSlots.is_due`` and ``reserve`` see the same answer within one schedule(). It never
changes what is generated: speculation is exact, on or off. ``speculative_config``'s
``auto_disable: false`` keeps speculation on at every batch up to ``disable_by_batch_size``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

EMA_WEIGHT = 0.25  # of the newest sample
MAX_INTERVAL_S = 0.5  # a longer gap between two updates is a pause, not a step


@dataclass
class _Bucket:
    rate: dict[bool, float | None] = field(default_factory=lambda: {True: None, False: None})
    speculating: bool = True
    steps: int = 0  # counted steps of the current kind since it was chosen (or the probe began)
    probing: bool = False
    probe_every: int = 0


class SpecGovernor:
    """Chooses per step whether to draft (``wants_drafts``) from what steps measured
    (``record``); see the module docstring."""

    def __init__(
        self,
        enabled: bool = True,
        first_probe: int = 24,
        probe_len: int = 8,
        max_probe_every: int = 1024,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.enabled = enabled
        self.first_probe = first_probe
        self.probe_len = probe_len
        self.max_probe_every = max_probe_every
        self.clock = clock
        self.buckets: dict[int, _Bucket] = {}
        self._last: tuple[float, int, bool] | None = None  # (time, bucket, kind) of a counted step
        self.num_switches = 0  # decisions that changed a bucket's kind (for stats and tests)

    def wants_drafts(self, num_running_seqs: int) -> bool:
        if not self.enabled:
            return True
        bucket = self.buckets.get(num_running_seqs.bit_length())
        return bucket is None or bucket.speculating

    def record(self, num_seqs: int, speculated: bool, num_tokens: int, counts: bool) -> None:
        """A step's update: ``num_seqs`` running sequences when it was planned, whether it was
        planned to speculate, the tokens it emitted, and whether it ``counts`` (a pure decode
        step). Updates that bucket's rate and, when due, its decision."""
        now = self.clock()
        last, self._last = self._last, None
        if not self.enabled or not counts or num_tokens <= 0:
            return
        key = num_seqs.bit_length()
        self._last = (now, key, speculated)
        if last is None or last[1] != key or last[2] != speculated:
            return  # a switch or a first step: no interval of this kind yet
        interval = now - last[0]
        if interval <= 0 or interval > MAX_INTERVAL_S:
            return
        bucket = self.buckets.setdefault(key, _Bucket(probe_every=self.first_probe))
        if speculated != bucket.speculating:
            return  # a step planned before the last switch
        sample = num_tokens / interval
        old = bucket.rate[speculated]
        bucket.rate[speculated] = sample if old is None else old + EMA_WEIGHT * (sample - old)
        bucket.steps += 1
        if bucket.probing and bucket.steps >= self.probe_len:
            self._decide(bucket)
        elif not bucket.probing and bucket.steps >= bucket.probe_every:
            bucket.probing, bucket.steps = True, 0
            bucket.speculating = not bucket.speculating

    def _decide(self, bucket: _Bucket) -> None:
        """The probe's end: keep the faster kind."""
        spec, plain = bucket.rate[True], bucket.rate[False]
        best = spec is not None and (plain is None or spec >= plain)
        left = not bucket.speculating  # the kind the probe left
        bucket.probing, bucket.steps = False, 0
        bucket.speculating = best
        if best == left:  # confirmed: probe less often
            bucket.probe_every = min(2 * bucket.probe_every, self.max_probe_every)
        else:
            bucket.probe_every = self.first_probe
            self.num_switches += 1

    def drafts_off_at(self) -> list[int]:
        """The lowest batch size of each bucket whose decision (not a probe) is plain decoding."""
        return [
            1 << (key - 1)
            for key, b in sorted(self.buckets.items())
            if not (b.speculating ^ b.probing)  # during a probe the decision is the other kind
        ]

    def describe(self) -> dict[str, dict]:
        """Per bucket (its lowest batch size): the kind running now (during a probe, the
        probed one), whether a probe runs, and both rates (tokens/s)."""
        return {
            str(1 << (key - 1)): {
                "speculating": b.speculating,
                "probing": b.probing,
                "spec_tokens_per_s": b.rate[True],
                "plain_tokens_per_s": b.rate[False],
            }
            for key, b in sorted(self.buckets.items())
        }
