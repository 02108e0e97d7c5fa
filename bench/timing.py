"""Shared GPU timing helper for the benchmarks: CUDA events, L2 flushed, medians."""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch

_FLUSH: torch.Tensor | None = None


def _flush_l2() -> None:
    """Overwrite a buffer larger than L2 (H200: 60 MB) so no run reads warm cache."""
    global _FLUSH
    if _FLUSH is None:
        _FLUSH = torch.empty(256 * 1024 * 1024, dtype=torch.int8, device="cuda")
    _FLUSH.zero_()


# GPU cycles of the spin kernel queued before each timed call (about 0.2 ms on an H200): the
# host's launch work for the call (Python, argument checks, allocations) then overlaps the spin,
# so the events time the device work alone. Without it, a call whose host side outlasts the
# L2 flush had that excess counted as device time (tens of microseconds for one small decode).
_SPIN_CYCLES = 400_000


def bench_ms(
    fn: Callable[[], object],
    *,
    warmup: int = 3,
    min_reps: int = 5,
    max_reps: int = 200,
    target_ms: float = 150.0,
    flush_l2: bool = True,
) -> dict[str, float]:
    """Median / min / max of ``fn``'s device time in ms, each rep timed by its own events
    (the GPU kept busy while the host launches it, see _SPIN_CYCLES).

    The number of reps is picked from a first estimate so that the total is about target_ms.
    """
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(_SPIN_CYCLES)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    estimate = max(start.elapsed_time(end), 1e-3)
    reps = int(min(max_reps, max(min_reps, target_ms / estimate)))
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for i in range(reps):
        if flush_l2:
            _flush_l2()
        torch.cuda._sleep(_SPIN_CYCLES)
        starts[i].record()
        fn()
        ends[i].record()
    torch.cuda.synchronize()
    times = [s.elapsed_time(e) for s, e in zip(starts, ends, strict=True)]
    return {"median_ms": statistics.median(times), "min_ms": min(times), "max_ms": max(times),
            "reps": reps}  # fmt: skip


def copy_bandwidth_gbs(num_bytes: int = 4 << 30) -> dict[str, float]:
    """Device-to-device copy bandwidth in GB/s, counting bytes read + bytes written."""
    src = torch.empty(num_bytes, dtype=torch.uint8, device="cuda").random_(0, 255)
    dst = torch.empty_like(src)
    t = bench_ms(lambda: dst.copy_(src), flush_l2=False, min_reps=10)
    return {"bytes": 2 * num_bytes, **t, "gbs": 2 * num_bytes / (t["median_ms"] * 1e6)}
