"""The disk tier's plain data: DiskBlockRecord, one block as its file slot describes it, and
DiskTierReport, what a step's disk I/O told the scheduler.

The scheduler sends a record with every block it asks a rank to write to disk
(``SchedulerOutput.disk_write_records``) or to read (``disk_read_records``: the block the slot
must hold), and the ranks read them back from their files at start (a warm restart:
``RunnerInfo.disk_records``) for the block manager to enter again.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class DiskBlockRecord:
    disk_block: int  # the slot in the disk tier
    uid: int  # the prefix-cache entry's uid (never 0; a child names its parent by it)
    parent_uid: int  # 0: the first block of a prompt
    hash: int  # chained 64-bit hash over the parent's hash, the token ids and the salt
    salt: str  # the prefix cache's salt (cache_salt, adapter included)
    token_ids: tuple[int, ...]  # block_size ids


@dataclass
class DiskTierReport:
    """What the ranks learned of their disk tiers in one step (``ModelRunnerOutput.disk_report``).

    ``failed_reads``: the step's reads that did not deliver their block on some rank (the slot
    changed underneath, a short read, a write that never landed): the scheduler drops the block
    from every tier and recomputes its readers, which have not run yet (a read's block is
    readable two steps later). ``failed_writes``: writes that did not land (their disk copies
    are dropped). ``are_writes_stopped``: a write failed; the tier takes no more writes.
    """

    failed_reads: list[tuple[int, int]] = field(default_factory=list)  # (disk_block, uid)
    failed_writes: list[tuple[int, int]] = field(default_factory=list)  # (disk_block, uid)
    are_writes_stopped: bool = False
