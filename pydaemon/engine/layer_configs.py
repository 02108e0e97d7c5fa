"""The engine's configuration split, once, into what each layer below it owns: the workers'
``RunnerConfig`` (handed to the executor) and the scheduler's ``SchedulerConfig`` (from the
configuration and what the ranks report once built). Below the engine nothing reads
``EngineConfig`` (tests/test_imports.py): a setting reaches a layer only through these.
"""

from __future__ import annotations

from pydaemon.config.engine import EngineConfig
from pydaemon.config.kv_offloading import kv_tier_plan
from pydaemon.config.runner import RunnerConfig


def runner_config(config: EngineConfig) -> RunnerConfig:
    """What every rank is built with (``config.model`` resolved by the front end)."""
    return RunnerConfig(
        model=config.model,
        device=config.device,
        dtype=config.dtype,
        load_format=config.load_format,
        seed=config.seed,
        quantization=config.quantization,
        block_size=config.block_size,
        num_kv_blocks=config.num_kv_blocks,
        gpu_memory_utilization=config.gpu_memory_utilization,
        cpu_kv_cache_space=config.cpu_kv_cache_space,
        kv_cache_dtype=config.kv_cache_dtype,
        calculate_kv_scales=config.calculate_kv_scales,
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        max_model_len=config.max_model_len,
        kv_tiers=kv_tier_plan(config),
        enforce_eager=config.enforce_eager,
        max_seq_len_to_capture=config.max_seq_len_to_capture,
        tensor_parallel_size=config.tensor_parallel_size,
        pipeline_parallel_size=config.pipeline_parallel_size,
        enable_expert_parallel=config.enable_expert_parallel,
        distributed_executor_backend=config.distributed_executor_backend,
        speculative=config.speculative,
        enable_lora=config.enable_lora,
        max_loras=config.max_loras,
        max_lora_rank=config.max_lora_rank,
        max_cpu_loras=config.max_cpu_loras,
    )
