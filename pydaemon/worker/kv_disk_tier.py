"""DiskTier: one rank's disk tier of the KV cache, a file of fixed-size block slots.

The scheduler decides which block goes to which slot (``SchedulerOutput.blocks_to_write_to_disk``
/ ``blocks_to_read_from_disk``, block_manager.h "Tiers"); this rank copies the bytes between its
CPU pool and its file, on one I/O thread, in step order. Bytes are copied as they are (an FP8
cache stays FP8).

File: ``DIR/<digest of the identity but the rank>/rank<r>-of-<n>.kvtier``: a 4 KiB file header (magic, format,
identity digest, slot size, slot count, the identity as JSON), then ``num_blocks`` slots of
``SLOT_HEADER_BYTES`` + the block's bytes (rounded up to 4 KiB). A slot header holds the
block's prefix-cache record (uid, parent uid, chained hash, salt, token ids), the CRC-32 of its
bytes and its own CRC. A write stores the bytes first and the header last, so a write cut
short leaves a slot whose CRC does not match: at start every slot is checked (header, identity,
bytes) and only whole ones are offered to the scheduler; anything else is ignored with a
warning, never served. The file is locked (flock) while a daemon uses it.

Ordering with the copy stream: a batch first waits for the copies issued before it (an event
recorded after them: the saves it writes out, the loads out of blocks it overwrites); the step
thread waits for a batch (``wait_for``) before its copies touch a CPU block that batch reads
or writes. The batch had a whole step to finish, so that wait is normally over at once.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import math
import os
import struct
import threading
import zlib
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from pydaemon.core.disk_blocks import DiskBlockRecord

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
FILE_MAGIC = b"PAGEDDKV"
SLOT_MAGIC = b"PDKVBLK1"
FILE_HEADER_BYTES = 4096
SLOT_HEADER_BYTES = 4096
_ALIGN = 4096
# magic, identity digest, uid, parent uid, hash, block_size, salt length, payload bytes,
# payload CRC; then the token ids, the salt, and the header's own CRC.
_SLOT_FIXED = struct.Struct("<8s32sQQQIIQI")
_FILE_FIXED = struct.Struct("<8sI32sQQQI")  # magic, format, digest, slot, slots, block, json


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


class DiskTier:
    """cpu_kv_cache: [num_cpu_blocks, num_layers, 2, num_kv_heads, block_size, head_dim], the
    rank's CPU pool (pinned on CUDA); its blocks are the source of writes and the target of
    reads."""

    def __init__(
        self,
        directory: str | os.PathLike,
        identity: dict,
        num_blocks: int,
        cpu_kv_cache: torch.Tensor,
        block_size: int,
        rank: int = 0,
        world_size: int = 1,
    ) -> None:
        if num_blocks < 1:
            raise ValueError(f"DiskTier: num_blocks must be >= 1, got {num_blocks}")
        self.identity_json = json.dumps(identity, sort_keys=True)
        self.digest = _digest(self.identity_json)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.block_bytes = math.prod(cpu_kv_cache.shape[1:]) * cpu_kv_cache.element_size()
        # [num_cpu_blocks, block_bytes] uint8, sharing the pool's memory (no copy).
        self.cpu_bytes: np.ndarray = (
            cpu_kv_cache.view(torch.uint8).reshape(len(cpu_kv_cache), self.block_bytes).numpy()
        )
        self.slot_bytes = SLOT_HEADER_BYTES + _round_up(self.block_bytes, _ALIGN)
        # One folder per model and settings, one file per rank in it (the rank is in the
        # file's identity, not the folder's).
        shared = {k: v for k, v in identity.items() if k != "tp_rank"}
        folder = Path(directory) / _digest(json.dumps(shared, sort_keys=True)).hex()[:16]
        folder.mkdir(parents=True, exist_ok=True)
        self.path = folder / f"rank{rank}-of-{world_size}.kvtier"
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._fd)
            raise RuntimeError(
                f"the disk tier file {self.path} is in use by another process (two daemons "
                "with the same model, settings and --kv-offloading-dir): give each its own "
                "directory"
            ) from None
        self._num_old_slots = self._open_header()
        self._crc: dict[int, int] = {}  # slot -> CRC of the bytes it holds (valid slots)
        self._io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pagedd-kv-disk")
        self._busy: dict[int, Future] = {}  # CPU block -> the last batch touching it
        self._last: Future | None = None  # the last batch queued
        self._lock = threading.Lock()
        self.num_corrupt_reads = 0

    # ---- start ------------------------------------------------------------------------------
    def _open_header(self) -> int:
        """Checks the file header; a file of another identity or layout is started afresh.
        Returns how many slots of the old file may hold blocks."""
        size = os.fstat(self._fd).st_size
        old_slots = 0
        if size >= FILE_HEADER_BYTES:
            raw = os.pread(self._fd, FILE_HEADER_BYTES, 0)
            magic, version, digest, slot_bytes, num_slots, block_bytes, _ = _FILE_FIXED.unpack_from(
                raw
            )
            if (magic, version, digest, slot_bytes, block_bytes) == (
                FILE_MAGIC,
                FORMAT_VERSION,
                self.digest,
                self.slot_bytes,
                self.block_bytes,
            ):
                old_slots = min(num_slots, self.num_blocks)
            else:
                logger.warning(
                    "disk tier: %s was written for another model or layout (or is not a KV "
                    "tier file): ignored, starting it afresh",
                    self.path,
                )
        elif size:
            logger.warning("disk tier: %s is too short for a header: starting it afresh", self.path)
        if old_slots == 0:
            os.ftruncate(self._fd, 0)
        identity = self.identity_json.encode()[: FILE_HEADER_BYTES - _FILE_FIXED.size]
        header = _FILE_FIXED.pack(
            FILE_MAGIC,
            FORMAT_VERSION,
            self.digest,
            self.slot_bytes,
            self.num_blocks,
            self.block_bytes,
            len(identity),
        )
        os.pwrite(self._fd, (header + identity).ljust(FILE_HEADER_BYTES, b"\0"), 0)
        os.ftruncate(self._fd, FILE_HEADER_BYTES + self.num_blocks * self.slot_bytes)
        return old_slots

    def scan(self) -> list[DiskBlockRecord]:
        """The whole blocks a previous run left here (header, identity and bytes checked)."""
        records: list[DiskBlockRecord] = []
        num_bad = 0
        payload = bytearray(self.block_bytes)
        for slot in range(self._num_old_slots):
            offset = self._offset(slot)
            raw = os.pread(self._fd, SLOT_HEADER_BYTES, offset)
            if raw[: len(SLOT_MAGIC)] != SLOT_MAGIC:
                continue  # never written
            parsed = self._parse_slot_header(raw, slot)
            if parsed is None:
                num_bad += 1
                continue
            record, crc = parsed
            if os.preadv(self._fd, [payload], offset + SLOT_HEADER_BYTES) != self.block_bytes or (
                zlib.crc32(payload) != crc
            ):
                num_bad += 1
                continue
            records.append(record)
            self._crc[slot] = crc
        if num_bad:
            logger.warning(
                "disk tier: %d slot(s) of %s are damaged or were cut short: ignored",
                num_bad,
                self.path,
            )
        return records

    def _parse_slot_header(self, raw: bytes, slot: int) -> tuple[DiskBlockRecord, int] | None:
        fixed = _SLOT_FIXED.unpack_from(raw)
        _, digest, uid, parent_uid, hash_, block_size, salt_len, payload_len, crc = fixed
        end = _SLOT_FIXED.size + 4 * block_size + salt_len
        if end + 4 > SLOT_HEADER_BYTES or block_size != self.block_size:
            return None
        (header_crc,) = struct.unpack_from("<I", raw, end)
        if zlib.crc32(raw[:end]) != header_crc:
            return None
        if digest != self.digest or payload_len != self.block_bytes or uid == 0:
            return None
        tokens = struct.unpack_from(f"<{block_size}i", raw, _SLOT_FIXED.size)
        try:
            salt = raw[_SLOT_FIXED.size + 4 * block_size : end].decode()
        except UnicodeDecodeError:
            return None
        return DiskBlockRecord(slot, uid, parent_uid, hash_, salt, tuple(tokens)), crc

    # ---- the step ---------------------------------------------------------------------------
    def submit(
        self,
        writes: list[tuple[int, int]],
        records: list[DiskBlockRecord],
        reads: list[tuple[int, int]],
        after: torch.cuda.Event | None,
    ) -> None:
        """Queue one step's writes ((cpu, disk) pairs, with their records) then reads
        ((disk, cpu) pairs), to run once ``after`` (the step's last copy) has completed."""
        if not writes and not reads:
            return
        future = self._io.submit(self._run_batch, list(writes), list(records), list(reads), after)
        with self._lock:
            self._last = future
            for cpu_block, _ in writes:
                self._busy[cpu_block] = future
            for _, cpu_block in reads:
                self._busy[cpu_block] = future

    def wait_for(self, cpu_blocks: Iterable[int]) -> None:
        """Returns once no queued batch reads or writes any of these CPU blocks (raises the
        batch's error, if it failed)."""
        with self._lock:
            busy = self._busy
            if not busy:
                return
            futures = {busy[b] for b in cpu_blocks if b in busy}
        for future in futures:
            future.result()
        with self._lock:
            for b in [b for b, f in self._busy.items() if f.done()]:
                del self._busy[b]

    def drain(self) -> None:
        """Waits for every queued batch (tests, shutdown); raises the error of one that
        failed."""
        with self._lock:
            last, futures = self._last, set(self._busy.values())
            self._busy.clear()
        for future in futures | ({last} if last is not None else set()):
            future.result()

    def close(self) -> None:
        """Finishes the queued batches and closes the file (idempotent; also at exit, when
        the I/O thread may already be stopped)."""
        if self._fd < 0:
            return
        self._io.shutdown(wait=True)
        os.close(self._fd)
        self._fd = -1

    def _run_batch(self, writes, records, reads, after) -> None:
        if after is not None:
            after.synchronize()  # this thread waits, never the step
        for (cpu_block, slot), record in zip(writes, records, strict=True):
            self._write(cpu_block, slot, record)
        for slot, cpu_block in reads:
            self._read(slot, cpu_block)

    def _write(self, cpu_block: int, slot: int, record: DiskBlockRecord) -> None:
        payload = self.cpu_bytes[cpu_block]
        crc = zlib.crc32(payload)
        offset = self._offset(slot)
        os.pwrite(self._fd, payload, offset + SLOT_HEADER_BYTES)  # the bytes first ...
        os.pwrite(self._fd, self._slot_header(record, crc), offset)  # ... then the header
        self._crc[slot] = crc

    def _read(self, slot: int, cpu_block: int) -> None:
        row = self.cpu_bytes[cpu_block]
        n = os.preadv(self._fd, [row], self._offset(slot) + SLOT_HEADER_BYTES)
        if n != self.block_bytes or zlib.crc32(row) != self._crc.get(slot):
            # Checked at start and written by this process since: the disk changed under it.
            self.num_corrupt_reads += 1
            logger.error(
                "disk tier: slot %d of %s no longer holds what was written", slot, self.path
            )

    def _slot_header(self, record: DiskBlockRecord, crc: int) -> bytes:
        salt = record.salt.encode()
        head = _SLOT_FIXED.pack(
            SLOT_MAGIC,
            self.digest,
            record.uid,
            record.parent_uid,
            record.hash,
            len(record.token_ids),
            len(salt),
            self.block_bytes,
            crc,
        )
        head += struct.pack(f"<{len(record.token_ids)}i", *record.token_ids) + salt
        return (head + struct.pack("<I", zlib.crc32(head))).ljust(SLOT_HEADER_BYTES, b"\0")

    def _offset(self, slot: int) -> int:
        return FILE_HEADER_BYTES + slot * self.slot_bytes


def _digest(identity_json: str) -> bytes:
    return hashlib.sha256(identity_json.encode()).digest()
