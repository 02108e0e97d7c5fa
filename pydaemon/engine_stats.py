"""Engine statistics (what operators and benchmarks read) and model-name resolution."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


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


def resolve_model_dir(model: str) -> Path:
    if model == "demo":
        from pydaemon.demo_model import demo_model_dir

        return demo_model_dir()
    path = Path(model).expanduser()
    if not path.is_dir():
        raise ValueError(f"model {model!r} is neither 'demo' nor a model directory")
    return path
