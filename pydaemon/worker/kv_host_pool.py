"""The host side of one rank's KV cache: the CPU pool (swap space + the CPU tier of the
prefix cache, one pool) and the disk tier behind it, sized from the runner's KV-tier plan
(config/kv_offloading.py: each rank's share of the tiers, in bytes). Every rank holds the
same number of blocks (the scheduler's one block manager drives them all). With a disk tier each rank scans its file (a warm restart)
and the ranks keep the slots that are whole on every one of them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from pydaemon.config.runner import RunnerConfig
from pydaemon.core.disk_blocks import DiskBlockRecord
from pydaemon.distributed import parallel_state as ps
from pydaemon.worker.kv_cache import KVCacheSpec
from pydaemon.worker.kv_disk_identity import kv_disk_identity
from pydaemon.worker.kv_disk_tier import DiskTier

logger = logging.getLogger(__name__)


@dataclass
class HostKV:
    # [num_cpu_blocks, num_layers, 2, num_kv_heads, block_size, head_dim] (pinned on CUDA)
    cpu_kv_cache: torch.Tensor
    num_swap_blocks: int
    num_cpu_tier_blocks: int
    disk: DiskTier | None = None
    disk_records: list[DiskBlockRecord] = field(default_factory=list)  # whole on every rank

    @property
    def num_cpu_blocks(self) -> int:
        return self.num_swap_blocks + self.num_cpu_tier_blocks

    @property
    def num_disk_blocks(self) -> int:
        return 0 if self.disk is None else self.disk.num_blocks


def build_host_kv(
    config: RunnerConfig,
    spec: KVCacheSpec,
    max_useful_swap_blocks: int,
    device: torch.device,
    weight_dtype: str,
) -> HostKV:
    tp_size, tp_rank = ps.get_tp_world_size(), ps.get_tp_rank()
    plan = config.kv_tiers
    num_swap = min(spec.num_blocks_for_bytes(plan.swap_bytes), max_useful_swap_blocks)
    num_tier = 0
    if plan.has_cpu_tier:
        num_tier = spec.num_blocks_for_bytes(plan.cpu_tier_bytes)
        if num_tier < 1:
            raise ValueError(
                f"kv_offloading_size {plan.cpu_tier_gib} GiB holds no KV block: one "
                f"block takes {spec.block_bytes * tp_size / 2**20:.2f} MiB over "
                f"{tp_size} rank(s)"
            )
    num_swap, num_tier = ps.min_across_ranks(num_swap), ps.min_across_ranks(num_tier)
    cpu_kv_cache = spec.allocate(
        num_swap + num_tier, torch.device("cpu"), pin_memory=device.type == "cuda"
    )
    host = HostKV(cpu_kv_cache, num_swap, num_tier)
    if plan.disk_dir:
        num_disk = spec.num_blocks_for_bytes(plan.disk_bytes)
        if num_disk < 1:
            raise ValueError(
                f"kv_offloading_disk_size {plan.disk_gib} GiB holds no KV "
                f"block: one block takes {spec.block_bytes * tp_size / 2**20:.2f} MiB over "
                f"{tp_size} rank(s)"
            )
        num_disk = ps.min_across_ranks(num_disk)
        identity = kv_disk_identity(config, weight_dtype, spec, tp_rank, tp_size)
        host.disk = DiskTier(
            plan.disk_dir,
            identity,
            num_disk,
            cpu_kv_cache,
            spec.block_size,
            tp_rank,
            tp_size,
        )
        host.disk_records = _whole_on_every_rank(host.disk.scan(), num_disk)
        if host.disk_records:
            logger.info(
                "disk tier: %d blocks of a previous run found in %s",
                len(host.disk_records),
                host.disk.path,
            )
    return host


def _whole_on_every_rank(records: list[DiskBlockRecord], num_slots: int) -> list[DiskBlockRecord]:
    """The records whose slot holds the same block (uid) whole on every rank: a rank may have
    lost a write another one finished (a crash), and a block is served only whole."""
    if ps.get_world_size() == 1:
        return records
    uids = torch.zeros(num_slots, dtype=torch.int64)  # 0: no whole block there
    for r in records:
        uids[r.disk_block] = r.uid
    low, high = ps.min_max_across_ranks(uids)
    agreed = (low == high) & (low != 0)
    kept = [r for r in records if agreed[r.disk_block]]
    if len(kept) < len(records):
        logger.warning(
            "disk tier: %d block(s) are not whole on every rank: ignored",
            len(records) - len(kept),
        )
    return kept
