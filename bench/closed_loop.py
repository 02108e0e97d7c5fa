"""A closed-loop driver of a multi-turn chat workload (bench/chat_workload.py) over any
engine that can be stepped in process, and its latency figures.

Conversations take turns round robin: at most ``max_active`` requests are in flight; when a
turn finishes, its conversation's next turn joins the back of the queue. With many more
conversations than ``max_active``, a conversation comes back only after the others have had a
turn, which is what pushes its history out of a small GPU KV cache. Times are taken on the host
at step granularity (time.perf_counter), the same way for every engine: TTFT from submission
to the step that returns the first token, TPOT = (end − first token) / (output tokens − 1)
(vLLM's definition), throughput over the whole run.

Where the engine reports a request's own timestamps (``request_metrics``: pagedd), TTFT is
broken down: ``queue_s`` (arrival to first scheduled step) and ``prefill_s`` (first scheduled
step to first token: the restores from the KV tiers and the prefill of what was not cached),
with ``cached_tokens`` (prompt tokens served from any cache tier). First turns (no history of
their own yet: after a restart only a disk tier can serve them) are reported apart.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

from bench.chat_workload import ChatWorkload


class SteppedEngine(Protocol):
    def submit(self, request_id: str, prompt: list[int], max_tokens: int) -> None: ...

    def step(self) -> list[tuple[str, int, bool]]:
        """One engine step -> (request_id, output tokens so far, finished) per request that
        changed."""
        ...

    def request_metrics(self, request_id: str) -> dict | None:
        """A finished request's {"queue_s", "prefill_s", "cached_tokens"}, or None if the
        engine reports none."""
        ...


@dataclass
class TurnRecord:
    conversation: int
    turn: int
    prompt_len: int
    submit_s: float
    first_token_s: float | None = None
    end_s: float | None = None
    num_output_tokens: int = 0
    engine: dict | None = None  # the engine's own breakdown (queue_s, prefill_s, cached_tokens)

    @property
    def ttft_s(self) -> float:
        return self.first_token_s - self.submit_s

    @property
    def tpot_s(self) -> float | None:
        if self.num_output_tokens < 2:
            return None
        return (self.end_s - self.first_token_s) / (self.num_output_tokens - 1)


@dataclass
class ClosedLoopResult:
    wall_s: float
    records: list[TurnRecord] = field(default_factory=list)
    num_steps: int = 0

    def figures(self) -> dict:
        ttft = [r.ttft_s for r in self.records]
        tpot = [t for r in self.records if (t := r.tpot_s) is not None]
        num_out = sum(r.num_output_tokens for r in self.records)
        num_prompt = sum(r.prompt_len for r in self.records)
        later = [r.ttft_s for r in self.records if r.turn > 0]  # turns with a history to reuse
        first = [r.ttft_s for r in self.records if r.turn == 0]
        return {
            "wall_s": self.wall_s,
            "num_requests": len(self.records),
            "num_steps": self.num_steps,
            "ttft_p50_s": percentile(ttft, 50),
            "ttft_p90_s": percentile(ttft, 90),
            "ttft_mean_s": statistics.fmean(ttft),
            "ttft_later_turns_p50_s": percentile(later, 50) if later else None,
            "ttft_first_turns_p50_s": percentile(first, 50) if first else None,
            **self._breakdown(),
            "tpot_p50_s": percentile(tpot, 50) if tpot else None,
            "tpot_p90_s": percentile(tpot, 90) if tpot else None,
            "output_tokens_per_s": num_out / self.wall_s,
            "total_tokens_per_s": (num_out + num_prompt) / self.wall_s,
            "requests_per_s": len(self.records) / self.wall_s,
        }

    def _breakdown(self) -> dict:
        """The engine's TTFT breakdown (p50s) and cached fractions, first turns apart."""
        out: dict = {}
        reported = [r for r in self.records if r.engine is not None]
        for key in ("queue_s", "prefill_s"):
            values = [r.engine[key] for r in reported if r.engine.get(key) is not None]
            out[f"{key[:-2]}_p50_s"] = percentile(values, 50) if values else None
        for name, keep in (("first_turns", lambda r: r.turn == 0),
                           ("later_turns", lambda r: r.turn > 0)):  # fmt: skip
            rows = [r for r in reported if keep(r)]
            prompt = sum(r.prompt_len for r in rows)
            out[f"cached_fraction_{name}"] = (
                sum(r.engine["cached_tokens"] for r in rows) / prompt if prompt else None
            )
        return out


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def run_closed_loop(
    engine: SteppedEngine, workload: ChatWorkload, max_active: int
) -> ClosedLoopResult:
    if max_active < 1:
        raise ValueError(f"max_active must be >= 1 (got {max_active})")
    conversations = workload.conversations
    ready = deque((c, 0) for c in range(len(conversations)))
    in_flight: dict[str, TurnRecord] = {}
    result = ClosedLoopResult(wall_s=0.0)
    start = time.perf_counter()
    while ready or in_flight:
        while ready and len(in_flight) < max_active:
            c, t = ready.popleft()
            turn = conversations[c][t]
            request_id = f"c{c}-t{t}"
            in_flight[request_id] = TurnRecord(c, t, len(turn.prompt), time.perf_counter())
            engine.submit(request_id, turn.prompt, turn.reply_len)
        changes = engine.step()
        result.num_steps += 1
        now = time.perf_counter()
        for request_id, num_tokens, finished in changes:
            record = in_flight[request_id]
            if num_tokens and record.first_token_s is None:
                record.first_token_s = now
            record.num_output_tokens = num_tokens
            if finished:
                record.end_s = now
                record.engine = engine.request_metrics(request_id)
                result.records.append(in_flight.pop(request_id))
                if record.turn + 1 < len(conversations[record.conversation]):
                    ready.append((record.conversation, record.turn + 1))
    result.wall_s = time.perf_counter() - start
    return result
