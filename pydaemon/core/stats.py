"""Engine statistics: what operators, metrics and benchmarks read of the engine core."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    num_swapped: int
    num_gpu_blocks: int
    num_free_gpu_blocks: int
    num_cpu_blocks: int
    num_free_cpu_blocks: int
    kv_waste_slots: int
    num_shared_blocks: int
    prefix_cache_query_tokens: int
    prefix_cache_hit_tokens: int
    num_preemptions: int
    num_swapped_out_blocks: int
    num_swapped_in_blocks: int
    num_prompt_tokens: int
    num_generation_tokens: int

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hit_tokens / max(1, self.prefix_cache_query_tokens)


@dataclass
class KVCacheStats:
    """The block manager's counters, as plain data."""

    num_gpu_blocks: int
    num_free_gpu_blocks: int
    num_cpu_blocks: int
    num_free_cpu_blocks: int
    kv_waste_slots: int
    num_shared_blocks: int
    prefix_cache_query_tokens: int
    prefix_cache_hit_tokens: int


@dataclass
class SchedulerStats:
    num_preemptions: int = 0
    num_swapped_out_blocks: int = 0
    num_swapped_in_blocks: int = 0
