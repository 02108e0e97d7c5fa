"""One rank's disk tier file (pydaemon/worker/kv_disk_tier.py): blocks written and read back
byte for byte (FP8 included), records found again by a later process, and every way a file or
slot can be wrong (damaged bytes or headers, a forged slot, a slot changed under a running
daemon, a failed write, another model's file, a second daemon) ignored, reported as a failed
read or refused with a clear error, never served."""

from __future__ import annotations

import errno
import hmac
import logging
import os

import pytest
import torch

from pydaemon.core.disk_blocks import DiskBlockRecord
from pydaemon.quantization.kv_cache_fp8 import FP8_DTYPE
from pydaemon.worker import kv_disk_tier
from pydaemon.worker.kv_disk_tier import FILE_HEADER_BYTES, SLOT_HEADER_BYTES, DiskTier

BLOCK_SHAPE = (2, 2, 2, 4, 8)  # [layers, 2, kv heads, block size, head dim]
IDENTITY = {"model": "tiny", "block_shape": list(BLOCK_SHAPE)}


def _pool(num_blocks: int, dtype=torch.float32, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(num_blocks, *BLOCK_SHAPE, generator=gen).to(dtype)


def _record(slot: int, uid: int, salt: str = "") -> DiskBlockRecord:
    return DiskBlockRecord(slot, uid, uid - 1, 1000 + uid, salt, tuple(range(uid, uid + 4)))


def _tier(path, pool: torch.Tensor, identity=IDENTITY, num_blocks: int = 4) -> DiskTier:
    return DiskTier(path, identity, num_blocks, pool, block_size=4)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def _write(tier: DiskTier, pairs: list[tuple[int, int]], uids: list[int]) -> None:
    """(cpu, slot) pairs, the block in slot s recorded as _record(s, uid)."""
    tier.submit(pairs, [_record(s, u) for (_, s), u in zip(pairs, uids, strict=True)], [], [], None)
    tier.drain()


def _read(tier: DiskTier, pairs: list[tuple[int, int]], uids: list[int]) -> list[tuple[int, int]]:
    """(slot, cpu) pairs -> the (slot, uid) of the reads that failed."""
    records = [_record(s, u) for (s, _), u in zip(pairs, uids, strict=True)]
    return tier.submit([], [], pairs, records, None).result()


def _slot_offset(tier: DiskTier, slot: int) -> int:
    return FILE_HEADER_BYTES + slot * tier.slot_bytes


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, FP8_DTYPE])
def test_write_then_read_back_byte_for_byte(tmp_path, dtype):
    pool = _pool(4, dtype)
    tier = _tier(tmp_path, pool)
    before = pool.clone()
    tier.submit([(0, 2), (3, 0)], [_record(2, 1), _record(0, 2, "salt")], [], [], None)
    tier.wait_for([0, 3])
    pool.zero_()
    reads = [(2, 1), (0, 2)]  # slot 2 -> CPU block 1, slot 0 -> block 2
    done = tier.submit([], [], reads, [_record(2, 1), _record(0, 2, "salt")], None)
    tier.wait_for([1, 2])
    assert done.result() == []
    assert torch.equal(_bytes(pool[1]), _bytes(before[0]))
    assert torch.equal(_bytes(pool[2]), _bytes(before[3]))
    assert tier.num_failed_reads == 0
    tier.close()
    # Another run finds both records, with their salts and tokens, and reads them back.
    pool = _pool(4, dtype, seed=1)
    again = _tier(tmp_path, pool)
    records = sorted(again.scan(), key=lambda r: r.uid)
    assert records == [_record(2, 1), _record(0, 2, "salt")]
    assert again.submit([], [], [(0, 3)], [_record(0, 2, "salt")], None).result() == []
    assert torch.equal(_bytes(pool[3]), _bytes(before[3]))
    again.close()


def test_damaged_headers_are_ignored_and_damaged_bytes_fail_their_read(tmp_path, caplog):
    tier = _tier(tmp_path, _pool(4))
    _write(tier, [(0, 0), (1, 1), (2, 2)], [1, 2, 3])
    path = tier.path
    offsets = [_slot_offset(tier, s) for s in range(3)]
    tier.close()
    with open(path, "r+b") as f:
        f.seek(offsets[1] + SLOT_HEADER_BYTES + 10)  # slot 1's bytes
        f.write(b"\xff\xfe")
        f.seek(offsets[2] + 20)  # slot 2's header
        f.write(b"\x00" * 8)
    with caplog.at_level(logging.WARNING):
        again = _tier(tmp_path, _pool(4))
        records = again.scan()
        # Start reads headers only (a slot each, not the tier's bytes): slot 1 is offered ...
        assert sorted(r.uid for r in records) == [1, 2]
        assert "1 slot(s)" in caplog.text and "damaged" in caplog.text
        # ... and its bytes fail their check when read: a failed read, never served.
        assert _read(again, [(0, 3), (1, 2)], [1, 2]) == [(1, 2)]
    assert again.num_failed_reads == 1 and "no longer holds what was written" in caplog.text
    again.close()


def test_a_forged_slot_is_never_served(tmp_path):
    """A forger rewrites a slot's bytes and recomputes every checksum it can: CRC-32s, or
    the MACs under a guessed key. Without the tier's key (0600, beside the file) the slot is
    ignored at start."""
    pool = _pool(4)
    tier = _tier(tmp_path, pool)
    _write(tier, [(0, 0)], [1])
    path, offset = tier.path, _slot_offset(tier, 0)
    tier.close()
    assert oct(os.stat(path.replace(".kvtier", ".key")).st_mode & 0o777) == "0o600"
    with open(path, "r+b") as f:
        f.seek(offset)
        header = bytearray(f.read(SLOT_HEADER_BYTES))
        forged = _pool(1, seed=7)[0].view(torch.uint8).numpy().tobytes()
        guess = bytes(32)
        mac = hmac.new(guess, bytes(header[: SLOT_HEADER_BYTES - 64]), "sha256")
        mac.update(forged)
        header[SLOT_HEADER_BYTES - 64 : SLOT_HEADER_BYTES - 32] = mac.digest()
        head = bytes(header[: SLOT_HEADER_BYTES - 32])
        header[SLOT_HEADER_BYTES - 32 :] = hmac.digest(guess, head, "sha256")
        f.seek(offset)
        f.write(header + forged)
    again = _tier(tmp_path, _pool(4))
    assert again.scan() == []
    again.close()


def test_a_slot_changed_under_a_running_daemon_is_a_failed_read(tmp_path, caplog):
    """Bytes overwritten (even with every MAC recomputed under the real key: the daemon
    compares with what it wrote), another slot copied in, or the file truncated: each read
    fails, is counted, and the log says so once, then sums up."""
    tier = _tier(tmp_path, _pool(4))
    _write(tier, [(0, 0), (1, 1), (2, 2)], [1, 2, 3])
    key = open(tier.path.replace(".kvtier", ".key"), "rb").read()
    with open(tier.path, "r+b") as f:
        f.seek(_slot_offset(tier, 0) + SLOT_HEADER_BYTES)  # slot 0: new bytes, MACs redone
        forged = bytes(tier.block_bytes)
        f.write(forged)
        f.seek(_slot_offset(tier, 0))
        header = bytearray(f.read(SLOT_HEADER_BYTES))
        mac = hmac.new(key, bytes(header[: SLOT_HEADER_BYTES - 64]), "sha256")
        mac.update(forged)
        header[SLOT_HEADER_BYTES - 64 : SLOT_HEADER_BYTES - 32] = mac.digest()
        head = bytes(header[: SLOT_HEADER_BYTES - 32])
        header[SLOT_HEADER_BYTES - 32 :] = hmac.digest(key, head, "sha256")
        f.seek(_slot_offset(tier, 0))
        f.write(header)
        f.seek(_slot_offset(tier, 2))  # slot 2 := slot 1, header and bytes
        f.write(open(tier.path, "rb").read()[_slot_offset(tier, 1) : _slot_offset(tier, 2)])
    with caplog.at_level(logging.WARNING):
        assert _read(tier, [(0, 0), (1, 1), (2, 2)], [1, 2, 3]) == [(0, 1), (2, 3)]
        os.truncate(tier.path, FILE_HEADER_BYTES)
        for _ in range(50):
            assert _read(tier, [(1, 1)], [2]) == [(1, 2)]
    assert tier.num_failed_reads == 52
    assert caplog.text.count("disk tier:") == 1  # the first one; the rest summed up later
    tier.close()


def test_a_write_error_stops_the_writes_and_is_reported(tmp_path, monkeypatch, caplog):
    pool = _pool(4)
    tier = _tier(tmp_path, pool)
    _write(tier, [(0, 0)], [1])
    real = kv_disk_tier._pwrite_all
    calls = []

    def full_disk(fd, data, offset):
        calls.append(offset)
        if len(calls) == 2:  # the second pwrite of a block: its bytes
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real(fd, data, offset)

    monkeypatch.setattr(kv_disk_tier, "_pwrite_all", full_disk)
    with caplog.at_level(logging.ERROR):
        _write(tier, [(1, 1), (2, 2), (3, 3)], [2, 3, 4])
    assert tier.are_writes_stopped and tier.num_failed_writes == 3
    assert len(calls) == 2  # nothing written after the error
    assert tier.take_failed_writes() == [(1, 2), (2, 3), (3, 4)]
    assert tier.take_failed_writes() == []
    assert caplog.text.count("No space left on device") == 1
    # The slots that failed are never served; the one written before still is.
    assert _read(tier, [(0, 0), (1, 1)], [1, 2]) == [(1, 2)]
    tier.close()


def test_another_models_file_is_started_afresh(tmp_path, caplog):
    tier = _tier(tmp_path, _pool(4))
    _write(tier, [(0, 0)], [1])
    path = tier.path
    tier.close()
    other = {**IDENTITY, "model": "another"}
    other_tier = _tier(tmp_path, _pool(4), other)
    other_path = other_tier.path
    other_tier.close()
    assert other_path != path  # each identity has its own folder ...
    os.replace(path, other_path)  # ... but a file moved into the wrong one is refused
    with caplog.at_level(logging.WARNING):
        moved = _tier(tmp_path, _pool(4), other)
        assert moved.scan() == []
    assert "written for another model or layout" in caplog.text
    moved.close()


def test_a_second_daemon_on_the_same_file_is_refused(tmp_path):
    tier = _tier(tmp_path, _pool(4))
    with pytest.raises(ValueError, match="--kv-offloading-dir: .* in use by another process"):
        _tier(tmp_path, _pool(4))
    tier.close()
    _tier(tmp_path, _pool(4)).close()  # free again once closed


def test_fewer_slots_keep_the_lower_ones(tmp_path):
    tier = _tier(tmp_path, _pool(4))
    _write(tier, [(0, 0), (1, 3)], [1, 2])
    tier.close()
    smaller = _tier(tmp_path, _pool(4), num_blocks=2)
    assert [r.disk_block for r in smaller.scan()] == [0]
    assert os.path.getsize(smaller.path) == FILE_HEADER_BYTES + 2 * smaller.slot_bytes
    smaller.close()


def test_a_lost_key_starts_the_file_afresh(tmp_path, caplog):
    tier = _tier(tmp_path, _pool(4))
    _write(tier, [(0, 0)], [1])
    path = tier.path
    tier.close()
    os.unlink(path.replace(".kvtier", ".key"))
    with caplog.at_level(logging.WARNING):
        again = _tier(tmp_path, _pool(4))
        assert again.scan() == []
    assert "has no key" in caplog.text
    again.close()


def test_a_tier_larger_than_the_free_space_is_refused_leaving_nothing(tmp_path):
    import shutil

    free = shutil.disk_usage(tmp_path).free
    slot_bytes = 2 * 4096  # a 4 KiB header and this pool's 512-byte blocks rounded up
    with pytest.raises(ValueError, match=r"--kv-offloading-disk-size: .* GiB free"):
        _tier(tmp_path / "new" / "tier", _pool(4), num_blocks=2 * free // slot_bytes)
    assert list(tmp_path.iterdir()) == []  # the folders it made are gone again


def test_the_weights_hash_cache_never_follows_a_symlink(tmp_path):
    from pydaemon.worker.kv_disk_folder import TierDir
    from pydaemon.worker.kv_disk_identity import HASH_CACHE_FILE, _read_cache, _write_cache

    outside = tmp_path / "outside.json"
    outside.write_text('{"planted": "yes"}')
    tier_dir = tmp_path / "tier"
    tier_dir.mkdir(mode=0o700)
    (tier_dir / HASH_CACHE_FILE).symlink_to(outside)
    root = TierDir.open_root(tier_dir)
    assert _read_cache(root) == {}  # not read through the link
    _write_cache(root, {"1:2:3:4:5": "ab"})
    root.close()
    assert outside.read_text() == '{"planted": "yes"}'  # replaced, never written through
    assert not (tier_dir / HASH_CACHE_FILE).is_symlink()
    again = TierDir.open_root(tier_dir)
    assert _read_cache(again) == {"1:2:3:4:5": "ab"}
    again.close()
