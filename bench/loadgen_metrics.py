"""Per-request timings from streamed chunks, and their aggregates, as in vLLM's benchmark_serving.

Definitions (all times in seconds from the benchmark's start, reported in ms):
- TTFT: first chunk carrying tokens minus the time the request was sent.
- E2E latency: the terminal frame's arrival minus the send time.
- TPOT: (E2E latency - TTFT) / (output tokens - 1), for requests with more than one token.
- ITL: the gaps between consecutive chunks of one request (a chunk may carry several tokens);
  every request's gaps are pooled.
- Throughput: completed requests (and their tokens) over the benchmark's duration, from the
  first send to the last terminal frame.
- Goodput: completed requests meeting every SLO (ttft_ms, tpot_ms, e2el_ms) per second.
"""

from __future__ import annotations

import math
import statistics
from collections import Counter
from dataclasses import asdict, dataclass, field

SLO_KEYS = ("ttft_ms", "tpot_ms", "e2el_ms")


@dataclass
class RequestRecord:
    """What one request did, as seen by the client."""

    index: int
    prompt_len: int | None
    requested_output_len: int
    scheduled_s: float = 0.0  # when the arrival process released it
    start_s: float = 0.0  # when it was sent (after waiting for a --max-concurrency slot)
    chunk_times_s: list[float] = field(default_factory=list)  # chunks carrying tokens
    chunk_num_tokens: list[int] = field(default_factory=list)
    end_s: float | None = None  # terminal frame (Finished or error) received
    num_output_tokens: int = 0  # Finished.usage.completion_tokens (or tokens streamed)
    num_cached_tokens: int = 0
    finish_reason: str | None = None
    error_code: str | None = None  # a grpc.StatusCode name; None when it succeeded
    error_message: str = ""
    server_timings_ms: dict[str, float] = field(default_factory=dict)

    @property
    def is_success(self) -> bool:
        return self.error_code is None and self.end_s is not None and bool(self.chunk_times_s)

    @property
    def ttft_s(self) -> float | None:
        return self.chunk_times_s[0] - self.start_s if self.chunk_times_s else None

    @property
    def latency_s(self) -> float | None:
        return None if self.end_s is None else self.end_s - self.start_s

    @property
    def tpot_s(self) -> float | None:
        if not self.is_success or self.num_output_tokens < 2:
            return None
        return (self.latency_s - self.ttft_s) / (self.num_output_tokens - 1)

    @property
    def itls_s(self) -> list[float]:
        t = self.chunk_times_s
        return [b - a for a, b in zip(t, t[1:], strict=False)]

    def to_json(self) -> dict:
        """Every field (chunk times rounded to the microsecond: W1 has 131k of them) plus the
        derived TTFT, TPOT and E2E in ms; ITLs are the gaps between ``chunk_times_s``."""
        d = asdict(self)
        d["chunk_times_s"] = [round(t, 6) for t in self.chunk_times_s]
        d.update(ttft_ms=_ms(self.ttft_s), tpot_ms=_ms(self.tpot_s), e2el_ms=_ms(self.latency_s))
        return d


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1e3


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation, as numpy.percentile's default."""
    if not values:
        return math.nan
    s = sorted(values)
    pos = (len(s) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def distribution_ms(values_s: list[float], percentiles: tuple[float, ...]) -> dict[str, float]:
    """mean, median, std, min, max and the asked percentiles of values (seconds), in ms."""
    ms = [v * 1e3 for v in values_s]
    if not ms:
        return {"count": 0}
    out = {
        "count": len(ms),
        "mean": statistics.fmean(ms),
        "median": statistics.median(ms),
        "std": statistics.pstdev(ms),
        "min": min(ms),
        "max": max(ms),
    }
    for q in percentiles:
        out[f"p{q:g}"] = percentile(ms, q)
    return out


def parse_slo(text: str | None) -> dict[str, float]:
    """``"ttft_ms=500,tpot_ms=50"`` -> {"ttft_ms": 500.0, "tpot_ms": 50.0}."""
    if not text:
        return {}
    slo: dict[str, float] = {}
    for part in text.split(","):
        key, sep, value = part.strip().partition("=")
        if not sep or key not in SLO_KEYS:
            raise ValueError(f"bad SLO {part!r}: expected KEY=MS with KEY in {', '.join(SLO_KEYS)}")
        try:
            slo[key] = float(value)
        except ValueError:
            raise ValueError(f"bad SLO {part!r}: {value!r} is not a number") from None
        if slo[key] <= 0:
            raise ValueError(f"bad SLO {part!r}: the target must be positive")
    return slo


def meets_slo(record: RequestRecord, slo: dict[str, float]) -> bool:
    if not record.is_success:
        return False
    values = {"ttft_ms": _ms(record.ttft_s), "tpot_ms": _ms(record.tpot_s),
              "e2el_ms": _ms(record.latency_s)}  # fmt: skip
    # A one-token request has no TPOT: it cannot miss a TPOT target (vLLM does the same).
    return all(values[k] is None or values[k] <= target for k, target in slo.items())


def aggregate(
    records: list[RequestRecord],
    duration_s: float,
    slo: dict[str, float] | None = None,
    percentiles: tuple[float, ...] = (50, 90, 99),
) -> dict:
    """Every aggregate figure of a run."""
    ok = [r for r in records if r.is_success]
    duration = max(duration_s, 1e-9)
    input_tokens = sum(r.prompt_len or 0 for r in ok)
    output_tokens = sum(r.num_output_tokens for r in ok)
    errors = Counter(r.error_code or "NO_TOKENS" for r in records if not r.is_success)
    out = {
        "duration_s": duration_s,
        "num_requests": len(records),
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "errors_by_status": dict(sorted(errors.items())),
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "total_cached_tokens": sum(r.num_cached_tokens for r in ok),
        "request_throughput": len(ok) / duration,
        "output_throughput": output_tokens / duration,
        "total_token_throughput": (input_tokens + output_tokens) / duration,
        "ttft_ms": distribution_ms([r.ttft_s for r in ok], percentiles),
        "tpot_ms": distribution_ms([r.tpot_s for r in ok if r.tpot_s is not None], percentiles),
        "itl_ms": distribution_ms([g for r in ok for g in r.itls_s], percentiles),
        "e2el_ms": distribution_ms([r.latency_s for r in ok], percentiles),
        "queue_wait_ms": distribution_ms([r.start_s - r.scheduled_s for r in records], percentiles),
    }
    if slo:
        good = sum(meets_slo(r, slo) for r in ok)
        out["slo"] = dict(slo)
        out["good_requests"] = good
        out["goodput"] = good / duration
    return out


def timeseries(records: list[RequestRecord], duration_s: float, bin_s: float | None = None) -> dict:
    """Output tokens/s and requests in flight over time, in bins of ``bin_s`` seconds."""
    if bin_s is None:
        bin_s = max(0.05, duration_s / 100)
    num_bins = max(1, math.ceil(duration_s / bin_s))
    tokens = [0] * num_bins
    for r in records:
        for t, n in zip(r.chunk_times_s, r.chunk_num_tokens, strict=False):
            tokens[min(num_bins - 1, max(0, int(t / bin_s)))] += n
    # time-averaged requests in flight within each bin
    in_flight = [0.0] * num_bins
    for r in records:
        end = r.end_s if r.end_s is not None else duration_s
        for b in range(max(0, int(r.start_s / bin_s)), min(num_bins, int(end / bin_s) + 1)):
            lo, hi = b * bin_s, (b + 1) * bin_s
            in_flight[b] += max(0.0, min(hi, end) - max(lo, r.start_s)) / bin_s
    return {
        "bin_s": bin_s,
        "time_s": [(b + 0.5) * bin_s for b in range(num_bins)],
        "output_tokens_per_s": [n / bin_s for n in tokens],
        "requests_in_flight": in_flight,
    }
