"""Engine statistics (what operators and benchmarks read) and model-name resolution."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pydaemon.default_model import DEFAULT_MODEL, default_model_path, is_default_model
from pydaemon.gguf.reader import is_gguf_file


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
    """-> the model directory or .gguf file that ``model`` names."""
    if model == "demo":
        from pydaemon.demo_model import demo_model_dir

        return demo_model_dir()
    if is_default_model(model):
        return default_model_path()
    path = Path(model).expanduser()
    if not (path.is_dir() or is_gguf_file(path)):
        raise ValueError(
            f"model {model!r} is neither 'demo', {DEFAULT_MODEL!r}, a model directory nor a "
            ".gguf file"
        )
    return path


def served_model_name(model: str, path: Path) -> str:
    """The name clients see: 'demo', the default model's, a directory's or a file's stem."""
    if model == "demo":
        return "demo"
    if is_default_model(model):
        return DEFAULT_MODEL
    return path.stem if is_gguf_file(path) else path.name
