"""SchedulerConfig: the settings the scheduler owns, as plain data. The engine core builds it
once (pydaemon/engine/layer_configs.py) from its configuration and what the ranks report
(the KV blocks they allocated, the step's token budget, the KV tiers and layer groups they
laid out); the scheduler reads nothing else. KVTierConfig: how its block manager keeps the
prefix cache beyond the GPU (block_manager.h, "Tiers")."""

from __future__ import annotations

from dataclasses import dataclass, field

from pydaemon.config.speculative import SpeculativeConfig
from pydaemon.core.disk_blocks import DiskBlockRecord
from pydaemon.core.kv_groups import KVGroups


@dataclass
class KVTierConfig:
    enable_cpu_tier: bool = False  # evicted GPU prefix blocks are kept in the CPU pool
    num_disk_blocks: int = 0  # the disk tier behind it; 0: none
    # Cached blocks at the head of the GPU free list saved to the CPU tier early, each step
    # (their eviction then costs no copy in the step that evicts them).
    save_ahead_blocks: int = 0
    kv_block_bytes: int = 0  # one block over every tensor-parallel rank (byte counters)
    disk_records: list[DiskBlockRecord] = field(default_factory=list)  # a warm restart's


@dataclass(frozen=True, kw_only=True)
class SchedulerConfig:
    block_size: int
    num_gpu_blocks: int
    num_cpu_blocks: int = 0  # swap space and the CPU tier (one pool)
    watermark: float = 0.0  # share of the GPU blocks kept back at admission
    max_num_seqs: int
    max_num_batched_tokens: int  # the step's token budget
    max_model_len: int
    preemption_mode: str = "auto"  # "auto" | "recompute" | "swap"
    enable_prefix_caching: bool = True
    speculative: SpeculativeConfig | None = None
    max_loras: int | None = None  # adapters in one batch; None: LoRA is off
    tiers: KVTierConfig = field(default_factory=KVTierConfig)  # default: no CPU or disk tier
    kv_window: int | None = None  # every layer's sliding window: older blocks are freed
    kv_groups: KVGroups | None = None  # windowed and global layers: a table per group
