"""Metrics under vLLM's names, for the routers and dashboards that read them, each labelled
with ``model_name``.

The Gateway API Inference Extension's endpoint picker and llm-d score a server by
``vllm:num_requests_waiting``, ``vllm:num_requests_running`` and ``vllm:kv_cache_usage_perc``
(a fraction in [0, 1], despite the name; older versions read ``vllm:gpu_cache_usage_perc``);
dashboards read the token and prefix-cache counters (``vllm:prompt_tokens_total``,
``vllm:generation_tokens_total``, ``vllm:prefix_cache_queries_total`` and ``_hits_total``, in
tokens, ``vllm:num_preemptions_total``, ``vllm:request_success_total{finished_reason}``) and the
histograms ``vllm:time_to_first_token_seconds``, ``vllm:inter_token_latency_seconds``,
``vllm:e2e_request_latency_seconds``, ``vllm:request_queue_time_seconds``,
``vllm:request_prompt_tokens`` and ``vllm:request_generation_tokens``; and (issue 55)
``vllm:num_requests_waiting_by_reason``, ``vllm:cache_config_info``,
``vllm:iteration_tokens_total``, ``vllm:request_params_n`` / ``_max_tokens`` and the phase
histograms ``vllm:request_{prefill,decode,inference}_time_seconds``. The values are the
``pagedd_*`` metrics' own (the inter-token histogram counts each request's intervals at its
mean interval: its sum and count are exact, its buckets coarser than vLLM's per-token ones).
LoRA info (``vllm:lora_requests_info``) is rendered with the LoRA gauges in metrics.py.
"""

from __future__ import annotations


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _label(model_name: str) -> str:
    return f'model_name="{_escape(model_name)}"'


def vllm_gauges(stats: object, model_name: str) -> list[str]:
    """Prometheus text lines of the vLLM-named gauges for one EngineStats."""
    total = stats.num_gpu_blocks
    usage = (total - stats.num_free_gpu_blocks) / total if total else 0.0
    label = f"{{{_label(model_name)}}}"
    gauges = (
        ("vllm:num_requests_running", "Requests being stepped.", stats.num_running),
        ("vllm:num_requests_waiting", "Requests waiting to be scheduled.", stats.num_waiting),
        ("vllm:kv_cache_usage_perc", "KV cache usage, 1 means 100 percent.", usage),
        ("vllm:gpu_cache_usage_perc", "KV cache usage (older name).", usage),
    )
    lines = []
    for name, help_text, value in gauges:
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} gauge", f"{name}{label} {value!r}"]
    return lines


# (vLLM's name, EngineStats counter, help)
_COUNTERS = (
    ("vllm:prompt_tokens_total", "num_prompt_tokens", "Prefill tokens processed."),
    ("vllm:generation_tokens_total", "num_generation_tokens", "Generation tokens processed."),
    ("vllm:num_preemptions_total", "num_preemptions", "Cumulative preemptions."),
    (
        "vllm:prefix_cache_queries_total",
        "prefix_cache_query_tokens",
        "Prefix cache queries, in tokens.",
    ),
    ("vllm:prefix_cache_hits_total", "prefix_cache_hit_tokens", "Prefix cache hits, in tokens."),
)


def vllm_counters(
    stats: object, baseline: dict[str, int], model_name: str, with_prefix_cache: bool = True
) -> list[str]:
    """The engine counters under vLLM's names, less ``baseline`` (the warm-up's); the prefix
    cache's only ``with_prefix_cache`` (KV tiers report theirs, GPU hits apart)."""
    label = f"{{{_label(model_name)}}}"
    lines = []
    for name, attr, help_text in _COUNTERS:
        if not with_prefix_cache and name.startswith("vllm:prefix_cache"):
            continue
        value = getattr(stats, attr) - baseline.get(attr, 0)
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} counter", f"{name}{label} {value}"]
    return lines


def vllm_waiting_by_reason(stats: object, model_name: str) -> list[str]:
    """``vllm:num_requests_waiting_by_reason{reason}``: of the waiting requests, "deferred"
    are held back by something else than room to run them (a grammar compiling), "capacity"
    the others; the two add up to ``vllm:num_requests_waiting``."""
    deferred = getattr(stats, "num_waiting_deferred", 0)
    name = "vllm:num_requests_waiting_by_reason"
    label = _label(model_name)
    return [
        f"# HELP {name} Waiting requests, by why they wait (capacity, deferred).",
        f"# TYPE {name} gauge",
        f'{name}{{{label},reason="capacity"}} {stats.num_waiting - deferred}',
        f'{name}{{{label},reason="deferred"}} {deferred}',
    ]


def vllm_cache_config_info(cache_config: dict[str, str], stats: object) -> list[str]:
    """``vllm:cache_config_info``: a gauge set to 1 whose labels are the KV cache's settings
    (vLLM's CacheConfig names) and the engine's block counts, with vLLM's ``engine`` label."""
    labels = {
        **cache_config,
        "num_gpu_blocks": str(stats.num_gpu_blocks),
        "num_cpu_blocks": str(stats.num_cpu_blocks),
        "engine": "0",
    }
    text = ",".join(f'{k}="{_escape(v)}"' for k, v in sorted(labels.items()))
    name = "vllm:cache_config_info"
    return [
        f"# HELP {name} Information of the LLMEngine CacheConfig.",
        f"# TYPE {name} gauge",
        f"{name}{{{text}}} 1.0",
    ]


def vllm_histograms(metrics, model_name: str) -> list[str]:
    """The request histograms under vLLM's names (``metrics``: a Metrics)."""
    label = _label(model_name)
    lines = metrics.ttft.render("vllm:time_to_first_token_seconds", label)
    lines += metrics.itl.render(label=label)
    lines += metrics.e2e.render("vllm:e2e_request_latency_seconds", label)
    for hist in (
        metrics.queue,
        metrics.prefill,
        metrics.decode,
        metrics.inference,
        metrics.prompt_tokens,
        metrics.generation_tokens,
        metrics.params_n,
        metrics.params_max_tokens,
    ):
        lines += hist.render(label=label)
    return lines


# pagedd's finish reasons -> vLLM's finished_reason label ("stop", "length", "abort")
_FINISHED_REASONS = {"stop": "stop", "length": "length"}


def vllm_request_success(finished: dict[str, int], model_name: str) -> list[str]:
    """``vllm:request_success_total{finished_reason}``: requests that ran to their end; every
    other way a request ended (cancelled, aborted, time limit) counts as "abort"."""
    counts: dict[str, int] = {}
    for reason, n in finished.items():
        key = _FINISHED_REASONS.get(reason, "abort")
        counts[key] = counts.get(key, 0) + n
    name = "vllm:request_success_total"
    lines = [f"# HELP {name} Finished requests, by finish reason.", f"# TYPE {name} counter"]
    for reason in ("stop", "length", "abort"):
        lines.append(
            f'{name}{{{_label(model_name)},finished_reason="{reason}"}} {counts.get(reason, 0)}'
        )
    return lines
