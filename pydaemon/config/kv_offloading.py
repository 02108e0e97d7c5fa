"""The KV tiers' settings (vLLM's flag names): ``kv_offloading_size`` GiB of host memory keep
evicted prefix-cache blocks (the CPU tier), ``kv_offloading_backend`` "native" (vLLM's name
for it: the only backend), ``kv_offloading_dir`` and ``kv_offloading_disk_size`` GiB the disk
tier behind it. Sizes are over every tensor-parallel rank together, as vLLM's, finite and at
most ``MAX_GIB``; the start checks them against the host (worker/kv_host_pool.py) and the
directory (worker/kv_disk_folder.py).

The one place that reads them: ``check_kv_offloading`` (when the engine's configuration is
built) and ``kv_tier_plan``, which resolves them, with the swap space, into what each rank
allocates (``KVTierPlan``, carried down in the workers' RunnerConfig)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

KV_OFFLOADING_BACKENDS = ("native",)
# The largest tier size taken at all (1 PiB): beyond, a size is a typo (1e12); the start
# checks each size against this host's memory and the disk's free space.
MAX_GIB = 1 << 20
GiB = 1 << 30


@dataclass(frozen=True)
class KVTierPlan:
    """The host side of each rank's KV cache, in bytes of one rank (the worker turns them into
    blocks: pydaemon/worker/kv_host_pool.py). The swap space is per rank; each rank holds its
    share of the CPU and disk tiers."""

    swap_bytes: float = 0.0  # the swap pool of swap preemption
    cpu_tier_bytes: float = 0.0  # the CPU tier of the prefix cache; 0: none
    disk_dir: str | None = None  # the disk tier's directory; None: no disk tier
    disk_bytes: float = 0.0
    # As set (GiB over every rank): what a refusal names.
    cpu_tier_gib: float | None = None
    disk_gib: float | None = None

    @property
    def has_cpu_tier(self) -> bool:
        return self.cpu_tier_bytes > 0


def kv_tier_plan(config) -> KVTierPlan:
    """The plan of an engine configuration (each rank: its tensor-parallel share)."""
    tp_size = config.tensor_parallel_size
    size, directory = config.kv_offloading_size, config.kv_offloading_dir
    return KVTierPlan(
        swap_bytes=config.swap_space * GiB,
        cpu_tier_bytes=size * GiB / tp_size if size else 0.0,
        disk_dir=directory or None,
        disk_bytes=config.kv_offloading_disk_size * GiB / tp_size if directory else 0.0,
        cpu_tier_gib=size,
        disk_gib=config.kv_offloading_disk_size,
    )


def check_kv_offloading(config, bad: Callable[[str, str], ValueError]) -> None:
    """Raises ``bad(field, why)`` for the first KV-tier setting that cannot work."""
    size = config.kv_offloading_size
    if size is not None and (not _is_number(size) or not 0 <= size <= MAX_GIB):
        raise bad(
            "kv_offloading_size",
            f"must be a number of GiB >= 0 and <= {MAX_GIB} (--kv-offloading-size; 0 or "
            "None: no CPU tier)",
        )
    backend = config.kv_offloading_backend
    if backend is not None and backend not in KV_OFFLOADING_BACKENDS:
        raise bad(
            "kv_offloading_backend",
            "must be 'native' (pagedd keeps the tiers in its own block manager; LMCache is "
            "not supported)",
        )
    if backend is not None and not size:
        raise bad("kv_offloading_backend", "needs kv_offloading_size (GiB of the CPU tier)")
    if size and not config.enable_prefix_caching:
        raise bad(
            "kv_offloading_size",
            "keeps evicted prefix-cache blocks: it needs enable_prefix_caching",
        )
    directory, disk_size = config.kv_offloading_dir, config.kv_offloading_disk_size
    if disk_size is not None and (not _is_number(disk_size) or not 0 < disk_size <= MAX_GIB):
        raise bad(
            "kv_offloading_disk_size",
            f"must be a number of GiB > 0 and <= {MAX_GIB} (--kv-offloading-disk-size)",
        )
    if directory is not None and not isinstance(directory, str):
        raise bad("kv_offloading_dir", "must be a directory path (--kv-offloading-dir)")
    if directory == "":
        raise bad("kv_offloading_dir", "must be a directory path, not empty (--kv-offloading-dir)")
    if directory and "\0" in directory:
        raise bad("kv_offloading_dir", "must not hold a NUL byte (--kv-offloading-dir)")
    if directory and disk_size is None:
        raise bad("kv_offloading_dir", "needs kv_offloading_disk_size (GiB of the disk tier)")
    if disk_size is not None and not directory:
        raise bad("kv_offloading_disk_size", "needs kv_offloading_dir (where the disk tier is)")
    if directory and not size:
        raise bad(
            "kv_offloading_dir",
            "the disk tier sits behind the CPU tier: it needs kv_offloading_size",
        )
    if directory and config.calculate_kv_scales:
        raise bad(
            "kv_offloading_dir",
            "cannot keep an FP8 cache whose scales are measured anew each run "
            "(calculate_kv_scales): a restarted daemon would read its blocks with other scales",
        )


def _is_number(value) -> bool:
    """A real, finite number (NaN and infinities are not sizes)."""
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
