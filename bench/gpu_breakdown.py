"""Where a whole run's GPU time goes: every kernel of the run (torch.profiler, CUDA activity
only) sorted into kinds by name, for pagedd's kernels and vLLM's alike, with the GPU's busy
time (the union of kernel intervals), the span from the first kernel to the last, and the
idle time between them (host gaps: the GPU waiting for launches).

Used by throughput.py ``--profile``: the timed ``generate`` runs under the profiler (so its
wall time is a profiled one; compare the unprofiled rows for speed) and the breakdown lands in
the result as ``gpu_breakdown``. pagedd attention splits into prefill and decode by kernel;
vLLM's FlashAttention serves both in one kernel ("attention").
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Iterable

KINDS = (  # first match wins: the specific kinds before the broad ones
    # MoE: routing, align/sort, combine and the experts' grouped GEMMs (pagedd's CUDA kernels,
    # CUTLASS grouped GEMMs behind torch._grouped_mm, vLLM's fused_moe Triton kernels)
    ("moe", re.compile(r"topk_route|moe_|fused_moe|GroupProblemShape|grouped", re.I)),
    ("attention (prefill)", re.compile(r"paged_prefill", re.I)),
    (
        "attention (decode)",
        re.compile(r"paged_decode|paged_attention|split_kv|reduce_partitions", re.I),
    ),  # fmt: skip
    ("rotary + cache write", re.compile(r"rotary|rope|reshape_and_cache|cache_kernel", re.I)),
    ("attention", re.compile(r"flash|fmha|attention|attn", re.I)),
    ("gemm", re.compile(r"gemm|cutlass|sm90_xmma|nvjet|cublas|matmul|Kernel2", re.I)),
    ("fp8 quantization", re.compile(r"fp8|quant", re.I)),
    ("norm", re.compile(r"rms_norm|layer_norm|rsqrt", re.I)),
    ("activation", re.compile(r"silu|act_and_mul|gelu", re.I)),
    ("sampling", re.compile(r"argmax|softmax|topk|sort|multinomial|exponential|sampl", re.I)),
    ("copies", re.compile(r"copy|memcpy|memset|cat|index|gather|scatter|fill", re.I)),
)


def kind_of(name: str) -> str:
    for kind, pattern in KINDS:
        if pattern.search(name):
            return kind
    return "other"


def breakdown(kernels: Iterable[tuple[str, float, float]], top: int = 15) -> dict:
    """kernels: (name, start_us, duration_us) -> GPU ms per kind, busy / span / idle ms, the
    ``top`` kernels by time."""
    per_kind: dict[str, float] = defaultdict(float)
    per_name: dict[str, float] = defaultdict(float)
    intervals = []
    for name, start, dur in kernels:
        per_kind[kind_of(name)] += dur
        per_name[name] += dur
        intervals.append((start, start + dur))
    intervals.sort()
    busy, end = 0.0, float("-inf")
    gaps = []  # (start_us, length_us): the GPU idle between kernels
    for a, b in intervals:  # the union: overlapping kernels (other streams) count once
        if a > end:
            if end != float("-inf"):
                gaps.append((end, a - end))
            busy += b - a
            end = b
        elif b > end:
            busy += b - end
            end = b
    span = max(b for _, b in intervals) - intervals[0][0] if intervals else 0.0
    kernel_ms = sum(per_kind.values()) / 1e3
    return {
        "num_kernels": len(intervals),
        "kernel_ms": kernel_ms,
        "busy_ms": busy / 1e3,
        "span_ms": span / 1e3,
        "idle_ms": (span - busy) / 1e3,
        "ms_by_kind": {k: v / 1e3 for k, v in sorted(per_kind.items(), key=lambda kv: -kv[1])},
        "top_kernels_ms": {
            n[:120]: v / 1e3 for n, v in sorted(per_name.items(), key=lambda kv: -kv[1])[:top]
        },
        "idle": idle_profile(gaps, intervals[0][0] if intervals else 0.0, span),
    }


GAP_BUCKETS_US = (10.0, 100.0, 1000.0, 10000.0)  # upper bounds; the last bucket is open


def idle_profile(gaps: list[tuple[float, float]], t0: float, span: float) -> dict:
    """Where the idle time is: gaps by length (a launch gap of microseconds against a host
    stall of milliseconds), idle ms in each tenth of the run (start-up, steady state, tail)
    and the longest gaps with their offset from the first kernel."""
    names = [f"<{b:g}us" for b in GAP_BUCKETS_US] + [f">={GAP_BUCKETS_US[-1]:g}us"]
    count = dict.fromkeys(names, 0)
    total = dict.fromkeys(names, 0.0)
    tenths = [0.0] * 10
    for start, length in gaps:
        i = next((j for j, b in enumerate(GAP_BUCKETS_US) if length < b), len(GAP_BUCKETS_US))
        count[names[i]] += 1
        total[names[i]] += length / 1e3
        if span > 0:
            tenths[min(9, int(10 * (start - t0) / span))] += length / 1e3
    longest = sorted(gaps, key=lambda g: -g[1])[:10]
    return {
        "gaps_by_length": {n: {"count": count[n], "ms": total[n]} for n in names},
        "ms_by_tenth_of_run": tenths,
        "longest_gaps_ms_at_ms": [(g[1] / 1e3, (g[0] - t0) / 1e3) for g in longest],
    }


def kernel_events(prof) -> list[tuple[str, float, float]]:
    """(name, start_us, duration_us) of every GPU kernel, memcpy and memset a finished
    torch.profiler.profile recorded (read from its raw kineto events: fast for 10^5 events)."""
    from torch.autograd import DeviceType

    out = []
    for e in prof.profiler.kineto_results.events():
        if e.device_type() != DeviceType.CUDA:
            continue
        if hasattr(e, "start_ns"):
            start, dur = e.start_ns() / 1e3, e.duration_ns() / 1e3
        else:
            start, dur = float(e.start_us()), float(e.duration_us())
        out.append((e.name(), start, dur))
    return out


class Profiled:
    """``with Profiled(enabled) as p: ...`` then ``p.result``: the breakdown of the kernels run
    inside (None when not enabled)."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.result: dict | None = None
        self._prof = None

    def __enter__(self) -> Profiled:
        if self.enabled:
            import torch

            self._prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
            self._prof.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self._prof is not None:
            import torch

            torch.cuda.synchronize()
            self._prof.__exit__(*exc)
            if exc[0] is None:
                self.result = breakdown(kernel_events(self._prof))
