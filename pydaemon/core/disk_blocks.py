"""DiskBlockRecord: one block of the disk tier, as its file slot describes it (plain data).

The scheduler sends one with every block it asks a rank to write to disk
(``SchedulerOutput.disk_write_records``), and the ranks read them back from their files at
start (a warm restart: ``RunnerInfo.disk_records``) for the block manager to enter again.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DiskBlockRecord:
    disk_block: int  # the slot in the disk tier
    uid: int  # the prefix-cache entry's uid (never 0; a child names its parent by it)
    parent_uid: int  # 0: the first block of a prompt
    hash: int  # chained 64-bit hash over the parent's hash, the token ids and the salt
    salt: str  # the prefix cache's salt (cache_salt, adapter included)
    token_ids: tuple[int, ...]  # block_size ids
