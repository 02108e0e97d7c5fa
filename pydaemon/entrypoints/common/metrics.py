"""Prometheus metrics in the text exposition format (served by metrics_http.MetricsServer).

Gauges and counters come from the engine's latest EngineStats (refreshed by the engine thread
after every step); latency histograms are fed by the servicer as requests finish.
"""

from __future__ import annotations

import bisect
import dataclasses
import threading
from collections.abc import Callable

from pydaemon.core.iteration_tokens import ITERATION_TOKENS_BUCKETS
from pydaemon.entrypoints.common.kv_tier_metrics import kv_tier_lines
from pydaemon.entrypoints.common.request_phases import RequestPhases, request_phases
from pydaemon.entrypoints.common.vllm_metrics import (
    vllm_cache_config_info,
    vllm_counters,
    vllm_gauges,
    vllm_histograms,
    vllm_request_success,
    vllm_waiting_by_reason,
)
from pydaemon.proto.pagedd.v1 import generation_pb2 as pb

TTFT_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
TPOT_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
E2E_BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
TOKEN_COUNT_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000)
# vLLM's buckets of its request phase histograms (queue, prefill, decode, inference) and of n
REQUEST_PHASE_BUCKETS_S = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
    240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
PARAMS_N_BUCKETS = (1, 2, 5, 10, 20)

# (metric name, EngineStats field, type, help)
_STATS = (
    ("pagedd_num_requests_running", "num_running", "gauge", "Requests being stepped."),
    ("pagedd_num_requests_waiting", "num_waiting", "gauge", "Requests waiting to be scheduled."),
    ("pagedd_num_requests_swapped", "num_swapped", "gauge", "Requests swapped out to CPU."),
    ("pagedd_kv_blocks_total", "num_gpu_blocks", "gauge", "Accelerator KV blocks in total."),
    ("pagedd_cpu_kv_blocks_total", "num_cpu_blocks", "gauge", "CPU swap KV blocks in total."),
    ("pagedd_kv_waste_slots", "kv_waste_slots", "gauge", "Allocated KV slots holding no token."),
    (
        "pagedd_prefix_cache_query_tokens_total",
        "prefix_cache_query_tokens",
        "counter",
        "Prompt tokens looked up in the prefix cache.",
    ),
    (
        "pagedd_prefix_cache_hit_tokens_total",
        "prefix_cache_hit_tokens",
        "counter",
        "Prompt tokens found in the prefix cache.",
    ),
    ("pagedd_preemptions_total", "num_preemptions", "counter", "Preemptions."),
    (
        "pagedd_swapped_out_blocks_total",
        "num_swapped_out_blocks",
        "counter",
        "KV blocks swapped out to CPU.",
    ),
    (
        "pagedd_swapped_in_blocks_total",
        "num_swapped_in_blocks",
        "counter",
        "KV blocks swapped back in.",
    ),
    ("pagedd_prompt_tokens_total", "num_prompt_tokens", "counter", "Prompt tokens processed."),
    ("pagedd_generation_tokens_total", "num_generation_tokens", "counter", "Tokens generated."),
)


# KVTierStats' counters (the others are gauges, or facts of the start: restored blocks)
_TIER_COUNTERS = (
    "gpu_hit_tokens",
    "cpu_hit_tokens",
    "disk_hit_tokens",
    "gpu_to_cpu_bytes",
    "cpu_to_gpu_bytes",
    "cpu_to_disk_bytes",
    "disk_to_cpu_bytes",
    "num_dropped_loads",
    "num_failed_disk_reads",
    "num_failed_disk_writes",
)


class Histogram:
    def __init__(self, name: str, help_text: str, buckets: tuple[float, ...]) -> None:
        self.name, self.help, self.buckets = name, help_text, buckets
        self.counts = [0] * (len(buckets) + 1)  # last: +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float, times: int = 1) -> None:
        """``times`` observations of ``value`` (the inter-token intervals of one request,
        each counted at the request's mean interval)."""
        self.counts[bisect.bisect_left(self.buckets, value)] += times
        self.sum += value * times
        self.count += times

    def render(self, name: str | None = None, label: str = "") -> list[str]:
        """The exposition lines, under ``name`` (default: its own) with ``label`` (e.g.
        'model_name="m"') on every sample."""
        name = name or self.name
        sep = "," if label else ""
        lines = [f"# HELP {name} {self.help}", f"# TYPE {name} histogram"]
        cumulative = 0
        for bound, n in zip((*self.buckets, float("inf")), self.counts, strict=True):
            cumulative += n
            le = "+Inf" if bound == float("inf") else repr(float(bound))  # "1.0", as vLLM
            lines.append(f'{name}_bucket{{{label}{sep}le="{le}"}} {cumulative}')
        braces = f"{{{label}}}" if label else ""
        lines += [f"{name}_sum{braces} {self.sum!r}", f"{name}_count{braces} {self.count}"]
        return lines


class Metrics:
    """Observed on the asyncio loop and rendered there; the lock keeps it safe from any thread."""

    def __init__(self, stats_fn: Callable[[], object]) -> None:
        self._stats_fn = stats_fn
        self.model_name: str | None = None  # once serving: the vLLM-named gauges carry it
        self._lock = threading.Lock()
        self.ttft = Histogram(
            "pagedd_time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS_S
        )
        self.tpot = Histogram(
            "pagedd_time_per_output_token_seconds",
            "Time per output token after the first.",
            TPOT_BUCKETS_S,
        )
        self.e2e = Histogram(
            "pagedd_e2e_request_latency_seconds", "Arrival to finish.", E2E_BUCKETS_S
        )
        # vLLM's names only (dashboards read them): see vllm_metrics.py
        self.itl = Histogram(
            "vllm:inter_token_latency_seconds",
            "Time between generated tokens (each request's intervals at its mean).",
            TPOT_BUCKETS_S,
        )
        self.queue = Histogram(
            "vllm:request_queue_time_seconds", "Arrival to first scheduled.", TTFT_BUCKETS_S
        )
        self.prompt_tokens = Histogram(
            "vllm:request_prompt_tokens", "Prompt tokens per request.", TOKEN_COUNT_BUCKETS
        )
        self.generation_tokens = Histogram(
            "vllm:request_generation_tokens",
            "Generated tokens per request.",
            TOKEN_COUNT_BUCKETS,
        )
        self.prefill = Histogram(
            "vllm:request_prefill_time_seconds",
            "First scheduled to first token (PREFILL phase).",
            REQUEST_PHASE_BUCKETS_S,
        )
        self.decode = Histogram(
            "vllm:request_decode_time_seconds",
            "First token to last token (DECODE phase).",
            REQUEST_PHASE_BUCKETS_S,
        )
        self.inference = Histogram(
            "vllm:request_inference_time_seconds",
            "First scheduled to last token (RUNNING phase).",
            REQUEST_PHASE_BUCKETS_S,
        )
        self.params_n = Histogram(
            "vllm:request_params_n", "The n request parameter.", PARAMS_N_BUCKETS
        )
        self.params_max_tokens = Histogram(
            "vllm:request_params_max_tokens",
            "The max_tokens request parameter (as the engine ran it).",
            TOKEN_COUNT_BUCKETS,
        )
        self.cache_config: dict[str, str] = {}  # the KV cache's settings (config/cache_info.py)
        self.finished: dict[str, int] = {}
        self._baseline: dict[str, int] = {}  # engine counters before serving (the warm-up)
        self._spec_baseline = None  # its speculative-decoding counters (SpecDecodeStats)
        self._stats_baseline = None  # the whole EngineStats then (KV tiers' counters)

    def set_baseline(self, stats: object) -> None:
        """Counters start from here: what the warm-up request did is not reported."""
        self._baseline = {
            attr: getattr(stats, attr, 0) for _, attr, kind, _ in _STATS if kind == "counter"
        }
        self._spec_baseline = getattr(stats, "spec_decode", None)
        self._stats_baseline = stats

    def since_serving(self, stats):
        """``stats`` (an EngineStats) with its counters less the warm-up's, as /metrics
        reports them: what GetServerStatus (``pagedd status``) answers. Gauges as they are."""
        if self._stats_baseline is None:
            return stats
        counters = {
            attr: getattr(stats, attr) - self._baseline.get(attr, 0)
            for _, attr, kind, _ in _STATS
            if kind == "counter"
        }
        spec, base = stats.spec_decode, self._spec_baseline
        if spec is not None and base is not None:
            counters["spec_decode"] = dataclasses.replace(
                spec,
                **{
                    attr: getattr(spec, attr) - getattr(base, attr) for _, attr, _ in _SPEC_COUNTERS
                },
                accepted_per_position=[
                    n
                    - (base.accepted_per_position[j] if j < len(base.accepted_per_position) else 0)
                    for j, n in enumerate(spec.accepted_per_position)
                ],
            )
        tiers, base_tiers = stats.kv_tiers, self._stats_baseline.kv_tiers
        if tiers is not None and base_tiers is not None:
            counters["kv_tiers"] = dataclasses.replace(
                tiers,
                **{
                    attr: getattr(tiers, attr) - getattr(base_tiers, attr)
                    for attr in _TIER_COUNTERS
                },
            )
        return dataclasses.replace(stats, **counters)

    def observe_request(self, account, finish_reason: int) -> None:
        timings = account.timings_ms()
        ttft_ms = timings.get("time_to_first_token_ms")
        queue_ms = timings.get("queue_ms")
        self.observe(
            pb.FinishReason.Name(finish_reason).removeprefix("FINISH_REASON_").lower(),
            ttft_s=None if ttft_ms is None else ttft_ms / 1e3,
            tpot_s=account.time_per_output_token_s(),
            e2e_s=timings["total_ms"] / 1e3,
            queue_s=None if queue_ms is None else queue_ms / 1e3,
            num_prompt_tokens=account.num_prompt_tokens,
            num_generation_tokens=account.num_completion_tokens,
            num_intervals=max(max(account.num_tokens_by_index.values(), default=0) - 1, 0),
            phases=request_phases(account.metrics),
            n=account.num_sequences,
            max_tokens=account.max_tokens,
        )

    def observe(
        self,
        finish_reason: str,
        *,
        ttft_s: float | None,
        tpot_s: float | None,
        e2e_s: float,
        queue_s: float | None = None,
        num_prompt_tokens: int = 0,
        num_generation_tokens: int = 0,
        num_intervals: int = 0,
        phases: RequestPhases | None = None,
        n: int | None = None,
        max_tokens: int | None = None,
    ) -> None:
        """One finished request, from any front end (gRPC or HTTP). ``num_intervals``: the
        gaps between its longest sequence's tokens (tpot_s is their mean); ``phases``: its
        engine phases; ``n``, ``max_tokens``: its sampling parameters (None: not known, as for
        a request refused before it had any)."""
        with self._lock:
            if ttft_s is not None:
                self.ttft.observe(ttft_s)
            if tpot_s is not None:
                self.tpot.observe(tpot_s)
                if num_intervals:
                    self.itl.observe(tpot_s, num_intervals)
            self.e2e.observe(e2e_s)
            if queue_s is not None:
                self.queue.observe(queue_s)
            self.prompt_tokens.observe(num_prompt_tokens)
            self.generation_tokens.observe(num_generation_tokens)
            for hist, value in (
                (self.prefill, phases and phases.prefill_s),
                (self.decode, phases and phases.decode_s),
                (self.inference, phases and phases.inference_s),
                (self.params_n, n),
                (self.params_max_tokens, max_tokens),
            ):
                if value is not None:
                    hist.observe(value)
            self.finished[finish_reason] = self.finished.get(finish_reason, 0) + 1

    def render(self) -> str:
        stats = self._stats_fn()
        lines = []
        for name, attr, kind, help_text in _STATS:
            lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
            lines.append(f"{name} {getattr(stats, attr, 0) - self._baseline.get(attr, 0)}")
        used = stats.num_gpu_blocks - stats.num_free_gpu_blocks
        hit_tokens = stats.prefix_cache_hit_tokens - self._baseline.get(
            "prefix_cache_hit_tokens", 0
        )
        query_tokens = stats.prefix_cache_query_tokens - self._baseline.get(
            "prefix_cache_query_tokens", 0
        )
        hit_rate = hit_tokens / query_tokens if query_tokens else 0.0
        lines += [
            "# HELP pagedd_kv_blocks_used Accelerator KV blocks in use.",
            "# TYPE pagedd_kv_blocks_used gauge",
            f"pagedd_kv_blocks_used {used}",
            "# HELP pagedd_kv_cache_usage_ratio Fraction of accelerator KV blocks in use.",
            "# TYPE pagedd_kv_cache_usage_ratio gauge",
            f"pagedd_kv_cache_usage_ratio {used / stats.num_gpu_blocks if stats.num_gpu_blocks else 0.0!r}",
            "# HELP pagedd_prefix_cache_hit_rate Prefix-cache hit tokens over query tokens.",
            "# TYPE pagedd_prefix_cache_hit_rate gauge",
            f"pagedd_prefix_cache_hit_rate {hit_rate!r}",
        ]
        spec = getattr(stats, "spec_decode", None)
        if spec is not None:
            lines += spec_decode_lines(spec, self._spec_baseline)
        if self.model_name is not None:
            lines += vllm_gauges(stats, self.model_name)
            lines += vllm_waiting_by_reason(stats, self.model_name)
            lines += self._iteration_tokens(stats).render(label=_model_label(self.model_name))
            lines += vllm_cache_config_info(self.cache_config, stats)
        has_tiers = getattr(stats, "kv_tiers", None) is not None  # --kv-offloading-size
        if self.model_name is not None:
            # With tiers, kv_tier_lines reports the prefix cache under vLLM's names (GPU hits).
            lines += vllm_counters(stats, self._baseline, self.model_name, not has_tiers)
        if has_tiers:
            lines += kv_tier_lines(stats, self._stats_baseline, self.model_name)
        lines += _lora_lines(stats)
        with self._lock:
            lines += [
                "# HELP pagedd_requests_finished_total Requests ended, by finish reason.",
                "# TYPE pagedd_requests_finished_total counter",
            ]
            for reason, n in sorted(self.finished.items()):
                lines.append(f'pagedd_requests_finished_total{{finish_reason="{reason}"}} {n}')
            for hist in (self.ttft, self.tpot, self.e2e):
                lines += hist.render()
            if self.model_name is not None:
                lines += vllm_histograms(self, self.model_name)
                lines += vllm_request_success(self.finished, self.model_name)
        return "\n".join(lines) + "\n"

    def _iteration_tokens(self, stats) -> Histogram:
        """The engine's tokens-per-step histogram, less the warm-up's steps."""
        hist = Histogram(
            "vllm:iteration_tokens_total",
            "Tokens per engine step (prompt tokens computed plus tokens generated).",
            ITERATION_TOKENS_BUCKETS,
        )
        steps = getattr(stats, "iteration_tokens", None)
        if steps is not None:
            before = getattr(self._stats_baseline, "iteration_tokens", None)
            steps = steps.minus(before)
            hist.counts, hist.sum, hist.count = list(steps.counts), steps.sum, steps.count
        return hist


def _model_label(model_name: str) -> str:
    return f'model_name="{_label(model_name)}"'


_SPEC_COUNTERS = (
    ("pagedd_spec_decode_num_drafts_total", "num_drafts", "Sequence steps that verified drafts."),
    ("pagedd_spec_decode_draft_tokens_total", "num_draft_tokens", "Draft tokens proposed."),
    ("pagedd_spec_decode_accepted_tokens_total", "num_accepted_tokens", "Draft tokens accepted."),
)


def spec_decode_lines(spec, baseline) -> list[str]:
    """Speculative decoding's counters (a SpecDecodeStats), less the warm-up's."""
    lines = []
    for name, attr, help_text in _SPEC_COUNTERS:
        value = getattr(spec, attr) - (getattr(baseline, attr) if baseline else 0)
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} counter", f"{name} {value}"]
    name = "pagedd_spec_decode_accepted_tokens_per_pos_total"
    lines += [
        f"# HELP {name} Draft tokens accepted, by position in the step's drafts (0: first).",
        f"# TYPE {name} counter",
    ]
    before = baseline.accepted_per_position if baseline else []
    for j, n in enumerate(spec.accepted_per_position):
        lines.append(f'{name}{{position="{j}"}} {n - (before[j] if j < len(before) else 0)}')
    return lines


def _lora_lines(stats) -> list[str]:
    """Requests per LoRA adapter, as pagedd gauges and as vLLM's ``vllm:lora_requests_info``
    (the adapter lists as labels: what LoRA-aware routers read)."""
    max_loras = getattr(stats, "max_loras", 0)
    if not max_loras:
        return []
    loads = stats.lora_requests
    lines = []
    for column, state in ((0, "running"), (1, "waiting")):
        name = f"pagedd_lora_requests_{state}"
        lines += [
            f"# HELP {name} Requests {state}, by LoRA adapter.",
            f"# TYPE {name} gauge",
        ]
        for adapter, counts in sorted(loads.items()):
            lines.append(f'{name}{{adapter="{_label(adapter)}"}} {counts[column]}')
    running = ",".join(_label(a) for a, (r, _) in sorted(loads.items()) if r)
    waiting = ",".join(_label(a) for a, (_, w) in sorted(loads.items()) if w)
    lines += [
        "# HELP vllm:lora_requests_info Running stats on lora requests.",
        "# TYPE vllm:lora_requests_info gauge",
        f'vllm:lora_requests_info{{max_lora="{max_loras}",running_lora_adapters="{running}",'
        f'waiting_lora_adapters="{waiting}"}} 1.0',
    ]
    return lines


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
