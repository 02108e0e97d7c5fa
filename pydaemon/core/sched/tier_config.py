"""KVTierConfig: how the scheduler's block manager keeps the prefix cache beyond the GPU
(block_manager.h, "Tiers"), as plain data the engine core builds from the runner's report."""

from __future__ import annotations

from dataclasses import dataclass, field

from pydaemon.core.disk_blocks import DiskBlockRecord


@dataclass
class KVTierConfig:
    enable_cpu_tier: bool = False  # evicted GPU prefix blocks are kept in the CPU pool
    num_disk_blocks: int = 0  # the disk tier behind it; 0: none
    # Cached blocks at the head of the GPU free list saved to the CPU tier early, each step
    # (their eviction then costs no copy in the step that evicts them).
    save_ahead_blocks: int = 0
    kv_block_bytes: int = 0  # one block over every tensor-parallel rank (byte counters)
    disk_records: list[DiskBlockRecord] = field(default_factory=list)  # a warm restart's
