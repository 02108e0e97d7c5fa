"""The engine gauges under vLLM's metric names, for routers that read them.

The Gateway API Inference Extension's endpoint picker and llm-d score a server by
``vllm:num_requests_waiting``, ``vllm:num_requests_running`` and ``vllm:kv_cache_usage_perc``
(a fraction in [0, 1], despite the name; older versions read ``vllm:gpu_cache_usage_perc``),
labelled with ``model_name``. The values are the same as the ``pagedd_*`` gauges'. LoRA info
(``vllm:lora_requests_info``) will follow once adapters exist.
"""

from __future__ import annotations


def vllm_gauges(stats: object, model_name: str) -> list[str]:
    """Prometheus text lines of the vLLM-named gauges for one EngineStats."""
    total = stats.num_gpu_blocks
    usage = (total - stats.num_free_gpu_blocks) / total if total else 0.0
    escaped = model_name.replace("\\", "\\\\").replace('"', '\\"')
    label = f'{{model_name="{escaped}"}}'
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
