"""Prometheus lines of the KV tiers (--kv-offloading-size): hits by tier, bytes moved each
way, what each tier holds; under vLLM's names where vLLM has them.

vLLM's: ``vllm:prefix_cache_queries`` / ``vllm:prefix_cache_hits`` (tokens looked up, tokens
served by GPU blocks), ``vllm:external_prefix_cache_queries`` / ``_hits`` (tokens looked up
below the GPU: those the GPU missed, and those the CPU or disk tier served), and
``vllm:kv_offload_total_bytes`` by ``transfer_type`` (GPU_to_CPU, CPU_to_GPU); as counters
they are exposed with the ``_total`` suffix, and labelled with ``model_name`` as vLLM's are.
pagedd's: ``pagedd_kv_tier_hit_tokens_total{tier}``, ``pagedd_kv_tier_bytes_total
{transfer_type}`` (the disk's transfers too), ``pagedd_kv_tier_blocks{tier}`` and
``pagedd_kv_tier_cached_blocks{tier}`` (occupancy), ``pagedd_kv_tier_dropped_loads_total``,
``pagedd_kv_tier_disk_errors_total{op}`` (reads not served, writes not stored) and
``pagedd_kv_tier_disk_writes_stopped`` (a write error stopped the disk tier's writes).
Counters start after the warm-up (``baseline``: the KVTierStats when serving began).
"""

from __future__ import annotations

_TRANSFERS = (
    ("GPU_to_CPU", "gpu_to_cpu_bytes"),
    ("CPU_to_GPU", "cpu_to_gpu_bytes"),
    ("CPU_to_DISK", "cpu_to_disk_bytes"),
    ("DISK_to_CPU", "disk_to_cpu_bytes"),
)


def kv_tier_lines(stats, baseline, model_name: str | None) -> list[str]:
    """``stats``: an EngineStats with ``kv_tiers`` set; ``baseline``: the KVTierStats (or
    EngineStats counters) to subtract, or None."""
    tiers = stats.kv_tiers

    def since(obj, base, attr: str) -> int:
        return getattr(obj, attr) - (getattr(base, attr) if base is not None else 0)

    base_tiers = getattr(baseline, "kv_tiers", None)
    queries = since(stats, baseline, "prefix_cache_query_tokens")
    gpu_hits = since(tiers, base_tiers, "gpu_hit_tokens")
    external_hits = since(tiers, base_tiers, "cpu_hit_tokens") + since(
        tiers, base_tiers, "disk_hit_tokens"
    )
    lines = [
        "# HELP pagedd_kv_tier_hit_tokens_total Prompt tokens served from the prefix cache, "
        "by the tier that held them.",
        "# TYPE pagedd_kv_tier_hit_tokens_total counter",
    ]
    for tier in ("gpu", "cpu", "disk"):
        value = since(tiers, base_tiers, f"{tier}_hit_tokens")
        lines.append(f'pagedd_kv_tier_hit_tokens_total{{tier="{tier}"}} {value}')
    lines += [
        "# HELP pagedd_kv_tier_bytes_total KV bytes copied between tiers, over all ranks.",
        "# TYPE pagedd_kv_tier_bytes_total counter",
    ]
    for kind, attr in _TRANSFERS:
        value = since(tiers, base_tiers, attr)
        lines.append(f'pagedd_kv_tier_bytes_total{{transfer_type="{kind}"}} {value}')
    lines += [
        "# HELP pagedd_kv_tier_blocks KV blocks of each tier below the GPU (the CPU pool is "
        "shared with swap).",
        "# TYPE pagedd_kv_tier_blocks gauge",
        f'pagedd_kv_tier_blocks{{tier="cpu"}} {stats.num_cpu_blocks}',
        f'pagedd_kv_tier_blocks{{tier="disk"}} {tiers.num_disk_blocks}',
        "# HELP pagedd_kv_tier_cached_blocks KV blocks of each tier holding a cached block.",
        "# TYPE pagedd_kv_tier_cached_blocks gauge",
        f'pagedd_kv_tier_cached_blocks{{tier="cpu"}} {tiers.num_cpu_cached_blocks}',
        f'pagedd_kv_tier_cached_blocks{{tier="disk"}} {tiers.num_disk_cached_blocks}',
        "# HELP pagedd_kv_tier_dropped_loads_total Loads cancelled: their sequence ended first.",
        "# TYPE pagedd_kv_tier_dropped_loads_total counter",
        f"pagedd_kv_tier_dropped_loads_total {since(tiers, base_tiers, 'num_dropped_loads')}",
        "# HELP pagedd_kv_tier_disk_errors_total Disk-tier blocks not served (op=read: the slot "
        "did not hold what was written; recomputed) or not stored (op=write: a failed write).",
        "# TYPE pagedd_kv_tier_disk_errors_total counter",
        f'pagedd_kv_tier_disk_errors_total{{op="read"}} '
        f"{since(tiers, base_tiers, 'num_failed_disk_reads')}",
        f'pagedd_kv_tier_disk_errors_total{{op="write"}} '
        f"{since(tiers, base_tiers, 'num_failed_disk_writes')}",
        "# HELP pagedd_kv_tier_disk_writes_stopped 1 once a write error stopped the disk "
        "tier's writes (until a restart; its blocks are still read, each checked).",
        "# TYPE pagedd_kv_tier_disk_writes_stopped gauge",
        f"pagedd_kv_tier_disk_writes_stopped {int(tiers.are_disk_writes_stopped)}",
    ]
    label = "" if model_name is None else f'model_name="{_escape(model_name)}"'
    counters = (
        ("vllm:prefix_cache_queries", "Prefix cache queries, in tokens.", queries),
        ("vllm:prefix_cache_hits", "Prefix cache hits, in tokens.", gpu_hits),
        (
            "vllm:external_prefix_cache_queries",
            "External prefix cache queries from KV connector cross-instance cache sharing, "
            "in tokens.",
            queries - gpu_hits,
        ),
        (
            "vllm:external_prefix_cache_hits",
            "External prefix cache hits from KV connector cross-instance cache sharing, in tokens.",
            external_hits,
        ),
    )
    for name, help_text, value in counters:
        lines += [
            f"# HELP {name} {help_text}",
            f"# TYPE {name} counter",
            f"{name}_total{{{label}}} {value}" if label else f"{name}_total {value}",
        ]
    name = "vllm:kv_offload_total_bytes"
    lines += [f"# HELP {name} Number of bytes offloaded by KV connector", f"# TYPE {name} counter"]
    for kind, attr in _TRANSFERS[:2]:
        labels = ",".join(filter(None, (label, f'transfer_type="{kind}"')))
        lines.append(f"{name}_total{{{labels}}} {since(tiers, base_tiers, attr)}")
    return lines


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
