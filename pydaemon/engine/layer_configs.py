"""The engine's configuration split, once, into what each layer below it owns: the workers'
``RunnerConfig`` (handed to the executor) and the scheduler's ``SchedulerConfig`` (from the
configuration and what the ranks report once built). Below the engine nothing reads
``EngineConfig`` (tests/test_imports.py): a setting reaches a layer only through these.
"""

from __future__ import annotations

from pydaemon.config.engine import EngineConfig
from pydaemon.config.kv_offloading import kv_tier_plan
from pydaemon.config.model import ModelConfig
from pydaemon.config.runner import RunnerConfig
from pydaemon.config.speculative import SpeculativeConfig
from pydaemon.core.model_info import RunnerInfo
from pydaemon.core.sched.scheduler_config import KVTierConfig, SchedulerConfig

# KV tiers: each step saves early at most this share of the CPU pool (ahead saves).
SAVE_AHEAD_POOL_SHARE = 8


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
    )


def scheduler_config(
    config: EngineConfig, info: RunnerInfo, model_config: ModelConfig
) -> SchedulerConfig:
    """What the scheduler is built with, once the ranks have reported what they built."""
    return SchedulerConfig(
        block_size=config.block_size,
        num_gpu_blocks=info.num_gpu_blocks,
        num_cpu_blocks=info.num_cpu_blocks,
        watermark=config.watermark,
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=info.max_num_batched_tokens,
        max_model_len=info.max_model_len,
        preemption_mode=config.preemption_mode,
        enable_prefix_caching=config.enable_prefix_caching,
        speculative=config.speculative,
        max_loras=config.max_loras if config.enable_lora else None,
        tiers=kv_tier_config(config, info),
        kv_window=kv_window(model_config, config.speculative),
        kv_groups=info.kv_groups,
    )


def kv_tier_config(config: EngineConfig, info: RunnerInfo) -> KVTierConfig:
    """The scheduler's KV tiers from what the ranks built. Each step saves early as many
    cached blocks as one step can evict (its token budget's worth), so that an eviction
    rarely waits for its copy, within a share of the CPU pool."""
    if not info.num_cpu_tier_blocks:
        return KVTierConfig()
    one_step = info.max_num_batched_tokens // config.block_size
    return KVTierConfig(
        enable_cpu_tier=True,
        num_disk_blocks=info.num_disk_blocks,
        save_ahead_blocks=min(one_step, info.num_cpu_blocks // SAVE_AHEAD_POOL_SHARE),
        kv_block_bytes=info.kv_block_bytes * config.tensor_parallel_size,
        disk_records=info.disk_records,
    )


def kv_window(model_config: ModelConfig, speculative: SpeculativeConfig | None) -> int | None:
    """The window every layer attends within, so that the scheduler frees the blocks that
    leave it; None when some layer sees the whole context (Gemma's and gpt-oss's global
    layers: per-layer-group tables serve those, core/kv_groups.py) or a draft model or EAGLE
    head with a KV cache of its own reads the same tables without a window."""
    windows = model_config.layer_sliding_windows
    if not windows or any(w is None for w in windows):
        return None
    if speculative is not None and speculative.method != "ngram":
        return None
    return max(windows)
