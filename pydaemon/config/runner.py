"""RunnerConfig: the settings a worker owns (its ModelRunner and what the runner builds: the
model, the KV cache and its host tiers, CUDA graphs, LoRA slots, a draft model), as plain
data. The engine resolves it once from its ``EngineConfig`` at the executor boundary
(pydaemon/engine/layer_configs.py) and the executors hand it to every rank: below the engine
nothing reads ``EngineConfig`` (tests/test_imports.py). The field names are EngineConfig's
(its docstring says what each means); ``speculative`` is parsed, and the KV tiers come as a
plan in bytes per rank (``KVTierPlan``, config/kv_offloading.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from pydaemon.config.kv_offloading import KVTierPlan
from pydaemon.config.speculative import SpeculativeConfig


@dataclass(frozen=True)
class RunnerConfig:
    # the model and its weights
    model: str  # the model directory or .gguf file (resolved by the front end)
    device: str
    dtype: str
    load_format: str
    seed: int
    quantization: str | None
    # the KV cache and the step
    block_size: int
    num_kv_blocks: int | None
    gpu_memory_utilization: float
    cpu_kv_cache_space: float
    kv_cache_dtype: str
    calculate_kv_scales: bool
    max_num_seqs: int
    max_num_batched_tokens: int | None
    max_model_len: int | None
    kv_tiers: KVTierPlan
    # CUDA graphs
    enforce_eager: bool
    max_seq_len_to_capture: int
    # the ranks
    tensor_parallel_size: int
    pipeline_parallel_size: int
    enable_expert_parallel: bool
    distributed_executor_backend: str
    # features with state in the runner
    speculative: SpeculativeConfig | None
    enable_lora: bool
    max_loras: int
    max_lora_rank: int

    @property
    def world_size(self) -> int:
        """Ranks in all: tensor_parallel_size x pipeline_parallel_size."""
        return self.tensor_parallel_size * self.pipeline_parallel_size
