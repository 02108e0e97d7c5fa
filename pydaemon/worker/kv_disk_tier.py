"""DiskTier: one rank's disk tier of the KV cache, a file of fixed-size block slots.

The scheduler decides which block goes to which slot (``SchedulerOutput.blocks_to_write_to_disk``
/ ``blocks_to_read_from_disk``, block_manager.h "Tiers"); this rank copies the bytes between its
CPU pool and its file, on one I/O thread, in step order. Bytes are copied as they are (an FP8
cache stays FP8).

Files: ``DIR/<digest of the identity but the rank>/rank<r>-of-<n>.kvtier`` and its key,
``rank<r>-of-<n>.key`` (32 random bytes), every path opened without following a symbolic
link (kv_disk_folder.py). The tier file: a 4 KiB file header (magic, format, identity digest,
slot size, slot count, the identity as JSON), then ``num_blocks`` slots of
``SLOT_HEADER_BYTES`` + the block's bytes (rounded up to 4 KiB). A slot header holds the
block's prefix-cache key (uid, parent uid, chained hash, salt, token ids), the slot's MAC
(HMAC-SHA256 under the key, over the header's fields and the block's bytes) and the header's
own MAC (over the fields and the slot's MAC).

What is served is what was written under that key, or a miss:
- start: each slot's header is checked (its MAC, the identity, the layout); the whole ones are
  offered to the scheduler, with the slot's MAC kept in memory. A file of another identity, a
  missing key, a damaged or forged header (a CRC recomputed is not a MAC) are ignored;
- a write stores the bytes first and the header last, having cleared the old header, so a
  write cut short leaves a slot that start ignores;
- a read (``blocks_to_read_from_disk`` with ``disk_read_records``: the block the scheduler
  expects there) gets the header and the bytes in one call and serves them only if the
  header's key is the expected block's, and the MAC of header and bytes is the one this
  process wrote or checked for that slot. Anything else (the file overwritten or truncated
  underneath, a short read, a slot whose write failed, another slot's bytes copied in) is a
  failed read: reported to the scheduler (``KVTransfer.disk_report``) before any step reads the
  block, which then drops it from every tier and recomputes it. Never served.
- a write that fails (ENOSPC, EIO, a short write) is logged once, counted, reported, and the
  tier takes no more writes this run (the blocks already there are still read, each verified).

Cost: the MAC hashes every block's bytes once on write and once on read (about 0.7 GB/s on
one core, on the I/O thread: hashlib releases the GIL); start reads one 4 KiB header a slot.

The file is locked (flock) while a daemon uses it.

Ordering with the copy stream: a step's reads, then its writes, run on the I/O thread after
the copies issued before them (an event recorded after them: the saves they write out, the
loads out of blocks they overwrite); the step thread waits for a batch (``wait_for``) before its
copies touch a CPU block that batch reads or writes. The batch had a whole step to finish, so
that wait is normally over at once.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import hmac
import json
import logging
import math
import os
import struct
import threading
import time
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

from pydaemon.core.disk_blocks import DiskBlockRecord
from pydaemon.worker.kv_disk_folder import TierDir, TierPathError

logger = logging.getLogger(__name__)

FORMAT_VERSION = 2  # 2: HMAC-SHA256 under a per-file key (1: CRC-32)
FILE_MAGIC = b"PAGEDDKV"
SLOT_MAGIC = b"PDKVBLK2"
FILE_HEADER_BYTES = 4096
SLOT_HEADER_BYTES = 4096
KEY_BYTES = 32
_ALIGN = 4096
_MAC_BYTES = 32
# magic, identity digest, uid, parent uid, hash, block_size, salt length, payload bytes; then
# the token ids and the salt, zeros, and at the end the slot's MAC and the header's MAC.
_SLOT_FIXED = struct.Struct("<8s32sQQQIIQ")
_SLOT_MAC = SLOT_HEADER_BYTES - 2 * _MAC_BYTES  # header[:_SLOT_MAC] + bytes -> the slot's MAC
_HEAD_MAC = SLOT_HEADER_BYTES - _MAC_BYTES  # header[:_HEAD_MAC] -> the header's MAC
_FILE_FIXED = struct.Struct("<8sI32sQQQI")  # magic, format, digest, slot, slots, block, json
_LOG_EVERY_S = 60.0  # failed reads after the first are summed up at most this often

DISK_SIZE_FLAG = "--kv-offloading-disk-size"


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


class DiskTier:
    """cpu_kv_cache: [num_cpu_blocks, num_layers, 2, num_kv_heads, block_size, head_dim], the
    rank's CPU pool (pinned on CUDA); its blocks are the source of writes and the target of
    reads. ``directory``: the tier directory (a path, or a TierDir already open: the caller
    keeps it)."""

    def __init__(
        self,
        directory: str | os.PathLike | TierDir,
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
        self._fd = -1
        owns_root = not isinstance(directory, TierDir)
        root = TierDir.open_root(directory) if owns_root else directory
        folder = None
        try:
            # One folder per model and settings, one file per rank in it (the rank is in the
            # file's identity, not the folder's).
            shared = {k: v for k, v in identity.items() if k != "tp_rank"}
            folder = root.subdir(_digest(json.dumps(shared, sort_keys=True)).hex()[:16])
            name = f"rank{rank}-of-{world_size}"
            self.path = os.path.join(folder.path, f"{name}.kvtier")
            self._fd = folder.open_file(f"{name}.kvtier")
            try:
                fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise TierPathError(
                    f"--kv-offloading-dir: the disk tier file {self.path} is in use by another "
                    "process (two daemons with the same model, settings and directory): give "
                    "each its own directory"
                ) from None
            self._key, is_new_key = _load_key(folder, f"{name}.key")
            self._num_old_slots = self._open_header(keep_slots=not is_new_key)
            root.forget_created()
        except BaseException:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1
            root.remove_created()
            raise
        finally:
            if folder is not None:
                folder.close()
            if owns_root:
                root.close()
        self._macs: dict[int, bytes] = {}  # slot -> the MAC of what it holds (whole slots)
        self._io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pagedd-kv-disk")
        self._busy: dict[int, Future] = {}  # CPU block -> the last batch touching it
        self._last: Future | None = None  # the last batch queued
        self._lock = threading.Lock()
        self._failed_writes: list[tuple[int, int]] = []  # (slot, uid), not yet reported
        self.are_writes_stopped = False
        self.num_failed_reads = 0
        self.num_failed_writes = 0
        self._num_unlogged_reads = 0
        self._next_read_log = 0.0

    # ---- start ------------------------------------------------------------------------------
    def _open_header(self, keep_slots: bool) -> int:
        """Checks the file header; a file of another identity or layout, or without its key,
        is started afresh. Returns how many slots of the old file may hold blocks."""
        st = os.fstat(self._fd)
        size = st.st_size
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
                old_slots = min(num_slots, self.num_blocks) if keep_slots else 0
                if not keep_slots:
                    logger.warning(
                        "disk tier: %s has no key (or a bad one): its blocks cannot be checked, "
                        "starting it afresh",
                        self.path,
                    )
            else:
                logger.warning(
                    "disk tier: %s was written for another model or layout (or is not a KV "
                    "tier file): ignored, starting it afresh",
                    self.path,
                )
        elif size:
            logger.warning("disk tier: %s is too short for a header: starting it afresh", self.path)
        file_bytes = FILE_HEADER_BYTES + self.num_blocks * self.slot_bytes
        self._check_space(st, file_bytes)
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
        os.ftruncate(self._fd, file_bytes)
        return old_slots

    def _check_space(self, st: os.stat_result, file_bytes: int) -> None:
        """The file's full size must fit on its file system (what it holds already counts)."""
        vfs = os.fstatvfs(self._fd)
        available = vfs.f_bavail * vfs.f_frsize + st.st_blocks * 512
        if file_bytes > available:
            raise ValueError(
                f"{DISK_SIZE_FLAG}: this rank's disk tier needs {file_bytes / 2**30:.2f} GiB "
                f"({self.num_blocks} blocks) but the file system of {self.path} has "
                f"{available / 2**30:.2f} GiB free: give a smaller size or free some space"
            )

    def scan(self) -> list[DiskBlockRecord]:
        """The blocks a previous run left here whose header checks (its MAC, the identity,
        the layout); their bytes are checked when read."""
        records: list[DiskBlockRecord] = []
        num_bad = 0
        header = bytearray(SLOT_HEADER_BYTES)
        for slot in range(self._num_old_slots):
            n = os.preadv(self._fd, [header], self._offset(slot))
            if n != SLOT_HEADER_BYTES or header[: len(SLOT_MAGIC)] != SLOT_MAGIC:
                continue  # never written (or cleared by a write cut short)
            parsed = self._parse_slot_header(header, slot)
            if parsed is None:
                num_bad += 1
                continue
            records.append(parsed)
            self._macs[slot] = bytes(header[_SLOT_MAC:_HEAD_MAC])
        if num_bad:
            logger.warning(
                "disk tier: %d slot(s) of %s are damaged or were not written under this "
                "file's key: ignored",
                num_bad,
                self.path,
            )
        return records

    def _parse_slot_header(self, raw: bytes | bytearray, slot: int) -> DiskBlockRecord | None:
        """The record of a header whose own MAC, identity and layout check; else None."""
        expected = hmac.digest(self._key, bytes(raw[:_HEAD_MAC]), "sha256")
        if not hmac.compare_digest(expected, bytes(raw[_HEAD_MAC:])):
            return None
        fixed = _SLOT_FIXED.unpack_from(raw)
        _, digest, uid, parent_uid, hash_, block_size, salt_len, payload_len = fixed
        end = _SLOT_FIXED.size + 4 * block_size + salt_len
        if end > _SLOT_MAC or block_size != self.block_size:
            return None
        if digest != self.digest or payload_len != self.block_bytes or uid == 0:
            return None
        tokens = struct.unpack_from(f"<{block_size}i", raw, _SLOT_FIXED.size)
        try:
            salt = bytes(raw[_SLOT_FIXED.size + 4 * block_size : end]).decode()
        except UnicodeDecodeError:
            return None
        return DiskBlockRecord(slot, uid, parent_uid, hash_, salt, tuple(tokens))

    # ---- the step ---------------------------------------------------------------------------
    def submit(
        self,
        writes: list[tuple[int, int]],
        write_records: list[DiskBlockRecord],
        reads: list[tuple[int, int]],
        read_records: list[DiskBlockRecord],
        after: torch.cuda.Event | None,
    ) -> Future | None:
        """Queue one step's reads ((disk, cpu) pairs, with the records of the blocks expected
        there) then writes ((cpu, disk) pairs, with their records), to run once ``after`` (the
        step's last copy) has completed. -> the reads' future (None without reads): its
        result is the (slot, uid) of each read that was not served."""
        reads_done = None
        if reads:
            reads_done = self._io.submit(self._run_reads, list(reads), list(read_records), after)
        writes_done = None
        if writes:
            writes_done = self._io.submit(
                self._run_writes, list(writes), list(write_records), after
            )
        with self._lock:
            self._last = writes_done or reads_done or self._last
            for _, cpu_block in reads:
                self._busy[cpu_block] = reads_done
            for cpu_block, _ in writes:
                self._busy[cpu_block] = writes_done
        return reads_done

    def take_failed_writes(self) -> list[tuple[int, int]]:
        """The (slot, uid) of the writes that did not land since the last call."""
        with self._lock:
            failed, self._failed_writes = self._failed_writes, []
        return failed

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

    # ---- the I/O thread ---------------------------------------------------------------------
    def _run_reads(self, reads, records, after) -> list[tuple[int, int]]:
        if after is not None:
            after.synchronize()  # this thread waits, never the step
        failed = []
        for (slot, cpu_block), record in zip(reads, records, strict=True):
            why = self._read(slot, cpu_block, record)
            if why is not None:
                self._macs.pop(slot, None)  # nothing there to serve until it is written again
                failed.append((slot, record.uid))
                self._note_failed_read(slot, why)
        return failed

    def _run_writes(self, writes, records, after) -> None:
        if after is not None:
            after.synchronize()
        for (cpu_block, slot), record in zip(writes, records, strict=True):
            self._write(cpu_block, slot, record)

    def _write(self, cpu_block: int, slot: int, record: DiskBlockRecord) -> None:
        self._macs.pop(slot, None)  # no longer what was there; not yet the new block
        if self.are_writes_stopped:
            self._note_failed_write(slot, record.uid, None)
            return
        payload = self.cpu_bytes[cpu_block]
        head = self._slot_header_fields(record)
        mac = _slot_mac(self._key, head, payload)
        header = head + mac + hmac.digest(self._key, head + mac, "sha256")
        offset = self._offset(slot)
        try:
            # The old header goes first: a write cut short leaves a slot start ignores.
            _pwrite_all(self._fd, bytes(len(SLOT_MAGIC)), offset)
            _pwrite_all(self._fd, payload, offset + SLOT_HEADER_BYTES)  # the bytes ...
            _pwrite_all(self._fd, header, offset)  # ... then the header
        except OSError as e:
            self._note_failed_write(slot, record.uid, e)
            return
        self._macs[slot] = mac

    def _read(self, slot: int, cpu_block: int, record: DiskBlockRecord) -> str | None:
        """Reads a slot into a CPU block; -> None if it holds ``record``'s block as written,
        else why not (the CPU block then holds nothing to serve)."""
        mac = self._macs.get(slot)
        if mac is None:
            return "the slot holds no whole block (its write failed or it was found damaged)"
        header = bytearray(SLOT_HEADER_BYTES)
        row = self.cpu_bytes[cpu_block]
        try:
            n = os.preadv(self._fd, [header, row], self._offset(slot))
        except OSError as e:
            return f"the read failed: {e.strerror or e}"
        if n != SLOT_HEADER_BYTES + self.block_bytes:
            return f"a short read ({n} of {SLOT_HEADER_BYTES + self.block_bytes} bytes)"
        head = bytes(header[:_SLOT_MAC])
        if head != self._slot_header_fields(record):
            return "its header names another block"
        if not hmac.compare_digest(_slot_mac(self._key, head, row), mac):
            return "its bytes are not those written"
        return None

    def _note_failed_read(self, slot: int, why: str) -> None:
        self.num_failed_reads += 1
        now = time.monotonic()
        if self.num_failed_reads == 1:
            logger.warning(
                "disk tier: slot %d of %s no longer holds what was written (%s): not served, "
                "its KV is computed again (further ones are summed up)",
                slot,
                self.path,
                why,
            )
            self._next_read_log = now + _LOG_EVERY_S
        elif now >= self._next_read_log:
            logger.warning(
                "disk tier: %d more block(s) of %s did not hold what was written: not served, "
                "recomputed (%d in all)",
                self._num_unlogged_reads + 1,
                self.path,
                self.num_failed_reads,
            )
            self._num_unlogged_reads = 0
            self._next_read_log = now + _LOG_EVERY_S
        else:
            self._num_unlogged_reads += 1

    def _note_failed_write(self, slot: int, uid: int, error: OSError | None) -> None:
        self.num_failed_writes += 1
        with self._lock:
            self._failed_writes.append((slot, uid))
        if error is not None and not self.are_writes_stopped:
            self.are_writes_stopped = True
            logger.error(
                "disk tier: writing to %s failed (%s): the disk tier takes no more blocks this "
                "run; the blocks already on disk are still served, each read checked. Free "
                "space (or fix the disk) and restart to write again",
                self.path,
                os.strerror(error.errno) if error.errno else error,
            )

    # ---- slots ------------------------------------------------------------------------------
    def _slot_header_fields(self, record: DiskBlockRecord) -> bytes:
        """The header up to the slot's MAC: the identity and the block's prefix-cache key."""
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
        )
        head += struct.pack(f"<{len(record.token_ids)}i", *record.token_ids) + salt
        return head.ljust(_SLOT_MAC, b"\0")

    def _offset(self, slot: int) -> int:
        return FILE_HEADER_BYTES + slot * self.slot_bytes


def _slot_mac(key: bytes, head: bytes, payload) -> bytes:
    mac = hmac.new(key, head, "sha256")
    mac.update(payload)  # the block's bytes, hashed where they are (no copy)
    return mac.digest()


def _pwrite_all(fd: int, data, offset: int) -> None:
    """pwrite that treats a short write as what it is (most often a full disk)."""
    view = memoryview(data).cast("B")
    n = os.pwrite(fd, view, offset)
    if n != len(view):
        raise OSError(errno.ENOSPC, f"short write ({n} of {len(view)} bytes)")


def _load_key(folder: TierDir, name: str) -> tuple[bytes, bool]:
    """The tier file's key (its MACs' secret), created if missing or malformed. -> (key,
    whether it is new: the file's old slots cannot be checked then)."""
    fd = folder.open_file(name)
    try:
        key = os.pread(fd, KEY_BYTES + 1, 0)
        if len(key) == KEY_BYTES:
            return key, False
        key = os.urandom(KEY_BYTES)
        os.ftruncate(fd, 0)
        _pwrite_all(fd, key, 0)
        os.fsync(fd)
        return key, True
    finally:
        os.close(fd)


def _digest(identity_json: str) -> bytes:
    return hashlib.sha256(identity_json.encode()).digest()
