"""The host side of one rank's KV cache: the CPU pool (swap space + the CPU tier of the
prefix cache, one pool) and the disk tier behind it, sized from the runner's KV-tier plan
(config/kv_offloading.py: each rank's share of the tiers, in bytes). Every rank holds the
same number of blocks (the scheduler's one block manager drives them all). With a disk tier
each rank scans its file (a warm restart) and the ranks keep the slots that are whole on
every one of them.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field

import torch

from pydaemon.config.runner import RunnerConfig
from pydaemon.core.disk_blocks import DiskBlockRecord
from pydaemon.core.kv_groups import KVGroups
from pydaemon.distributed import parallel_state as ps
from pydaemon.worker.kv_cache import GiB, KVCacheSpec
from pydaemon.worker.kv_disk_folder import TierDir
from pydaemon.worker.kv_disk_identity import kv_disk_identity
from pydaemon.worker.kv_disk_tier import DiskTier

logger = logging.getLogger(__name__)

# Pinned host memory is never paged out: a pool above this share of the host's memory is
# refused, above the second share a warning (vLLM's thresholds for its swap space).
MAX_PINNED_SHARE, WARN_PINNED_SHARE = 0.7, 0.4

# The disk tier's blocks at most: the scheduler keeps a prefix-cache entry slot (a few hundred
# bytes) for each, and a start reads each slot's header.
MAX_DISK_BLOCKS = 1 << 22


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
    kv_groups: KVGroups | None = None,
) -> HostKV:
    tp_size = ps.get_tp_world_size()
    plan = config.kv_tiers
    num_swap = min(spec.num_blocks_for_bytes(plan.swap_bytes), max_useful_swap_blocks)
    num_tier = 0
    if plan.has_cpu_tier:
        num_tier = spec.num_blocks_for_bytes(plan.cpu_tier_bytes)
    num_swap, num_tier = ps.min_across_ranks(num_swap), ps.min_across_ranks(num_tier)
    if plan.has_cpu_tier:
        if num_tier < 1:
            raise ValueError(
                f"kv_offloading_size (--kv-offloading-size) {plan.cpu_tier_gib} GiB "
                f"holds no KV block: one block takes {spec.block_bytes * tp_size / 2**20:.2f} "
                f"MiB over {tp_size} rank(s)"
            )
        memory = _host_memory_bytes()
        if num_tier * spec.block_bytes > memory:
            raise ValueError(
                f"kv_offloading_size (--kv-offloading-size) {plan.cpu_tier_gib} GiB: "
                f"this rank's share, {num_tier * spec.block_bytes / GiB:.1f} GiB, is more than "
                f"this host's memory ({memory / GiB:.1f} GiB)"
            )
    _check_swap_space(plan.swap_bytes, num_swap * spec.block_bytes, pinned=device.type == "cuda")
    cpu_kv_cache = spec.allocate_host_pool(num_swap + num_tier, pin_memory=device.type == "cuda")
    host = HostKV(cpu_kv_cache, num_swap, num_tier)
    if plan.disk_dir:
        host.disk, host.disk_records = _open_disk_tier(
            config, spec, cpu_kv_cache, weight_dtype, kv_groups
        )
    return host


def _open_disk_tier(
    config: RunnerConfig,
    spec: KVCacheSpec,
    cpu_kv_cache: torch.Tensor,
    weight_dtype: str,
    kv_groups: KVGroups | None,
) -> tuple[DiskTier, list[DiskBlockRecord]]:
    """Opens this rank's disk tier and finds the blocks a previous run left there."""
    tp_size, tp_rank = ps.get_tp_world_size(), ps.get_tp_rank()
    plan = config.kv_tiers
    num_disk = spec.num_blocks_for_bytes(plan.disk_bytes)
    num_disk = ps.min_across_ranks(min(num_disk, MAX_DISK_BLOCKS + 1))  # the same on every rank
    if num_disk < 1:
        raise ValueError(
            f"kv_offloading_disk_size (--kv-offloading-disk-size) "
            f"{plan.disk_gib} GiB holds no KV block: one block takes "
            f"{spec.block_bytes * tp_size / 2**20:.2f} MiB over {tp_size} rank(s)"
        )
    if num_disk > MAX_DISK_BLOCKS:
        raise ValueError(
            f"kv_offloading_disk_size (--kv-offloading-disk-size) "
            f"{plan.disk_gib} GiB is more than {MAX_DISK_BLOCKS} blocks of "
            f"this model ({spec.block_bytes / 2**10:.0f} KiB each on this rank), the most the "
            f"scheduler keeps books for: give at most "
            f"{MAX_DISK_BLOCKS * spec.block_bytes * tp_size / GiB:.1f} GiB"
        )
    root = TierDir.open_root(plan.disk_dir)
    try:
        identity = kv_disk_identity(
            config, weight_dtype, spec, tp_rank, tp_size, kv_groups, hash_cache=root
        )
        identity["pp_rank"] = ps.get_pp_rank()  # a stage holds its own layers
        identity["pp_size"] = ps.get_pp_world_size()
        disk = DiskTier(
            root,
            identity,
            num_disk,
            cpu_kv_cache,
            spec.block_size,
            ps.get_rank(),
            ps.get_world_size(),
        )
    except BaseException:
        root.remove_created()
        raise
    finally:
        root.close()
    records = _whole_on_every_rank(disk.scan(), num_disk)
    if records:
        logger.info("disk tier: %d blocks of a previous run found in %s", len(records), disk.path)
    return disk, records


def _check_swap_space(swap_bytes: float, num_bytes: int, pinned: bool) -> None:
    """The swap pool against the host's memory. Pinned (CUDA) pages are resident from the
    start: above MAX_PINNED_SHARE of the memory is refused. Unpinned (a CPU engine) pages are
    committed only as swapped blocks are written, so a large pool costs nothing until
    preemptions fill it: above the host's memory it is only said. ``swap_bytes``: asked for;
    ``num_bytes``: the pool's (capped at the blocks it can ever hold)."""
    memory = _host_memory_bytes()
    flag = f"swap_space (--swap-space) {swap_bytes / GiB:g} GiB"
    if pinned and num_bytes > MAX_PINNED_SHARE * memory:
        raise ValueError(
            f"{flag}: {num_bytes / GiB:.1f} GiB of pinned host memory on this rank is more "
            f"than {MAX_PINNED_SHARE:.0%} of this host's {memory / GiB:.1f} GiB; give less "
            "(0: no swap space, preemption by recompute)"
        )
    if pinned and num_bytes > WARN_PINNED_SHARE * memory:
        logger.warning(
            "%s: %.1f GiB of pinned host memory on this rank, %.0f%% of this host's",
            flag,
            num_bytes / GiB,
            100 * num_bytes / memory,
        )
    if not pinned and num_bytes > memory:
        logger.warning(
            "%s is more than this host's memory (%.1f GiB): swap preemption may exhaust it",
            flag,
            memory / GiB,
        )


def _host_memory_bytes() -> int:
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


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
