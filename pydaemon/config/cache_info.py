"""The KV cache's settings as vLLM's ``vllm:cache_config_info`` labels them: vLLM's
CacheConfig field names, values as Python's str() writes them ("True", "None", "0.9").
num_gpu_blocks and num_cpu_blocks are the engine's (known once it runs): the metrics add
them from its stats."""

from __future__ import annotations

from typing import Any

# (vLLM's CacheConfig field, EngineConfig attribute)
_FIELDS = (
    ("block_size", "block_size"),
    ("gpu_memory_utilization", "gpu_memory_utilization"),
    ("swap_space", "swap_space"),
    ("cache_dtype", "kv_cache_dtype"),
    ("num_gpu_blocks_override", "num_kv_blocks"),
    ("enable_prefix_caching", "enable_prefix_caching"),
    ("calculate_kv_scales", "calculate_kv_scales"),
    ("kv_offloading_size", "kv_offloading_size"),
    ("kv_offloading_backend", "kv_offloading_backend"),
)


def cache_config_info(config: Any) -> dict[str, str]:
    """The labels of ``config`` (an EngineConfig; a stand-in's missing settings left out)."""
    return {label: str(getattr(config, attr)) for label, attr in _FIELDS if hasattr(config, attr)}
