"""One rank's disk tier file (pydaemon/worker/kv_disk_tier.py): blocks written and read back
byte for byte (FP8 included), records found again by a later process, and every way a file or
slot can be wrong (damaged bytes, a header cut short, another model's file, a second daemon)
ignored with a warning or refused with a clear error, never served."""

from __future__ import annotations

import logging
import os

import pytest
import torch

from pydaemon.core.disk_blocks import DiskBlockRecord
from pydaemon.quantization.kv_cache_fp8 import FP8_DTYPE
from pydaemon.worker.kv_disk_tier import FILE_HEADER_BYTES, DiskTier

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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, FP8_DTYPE])
def test_write_then_read_back_byte_for_byte(tmp_path, dtype):
    pool = _pool(4, dtype)
    tier = _tier(tmp_path, pool)
    before = pool.clone()
    tier.submit([(0, 2), (3, 0)], [_record(2, 1), _record(0, 2, "salt")], [], None)
    tier.wait_for([0, 3])
    pool.zero_()
    tier.submit([], [], [(2, 1), (0, 2)], None)  # slot 2 -> CPU block 1, slot 0 -> block 2
    tier.wait_for([1, 2])
    assert torch.equal(_bytes(pool[1]), _bytes(before[0]))
    assert torch.equal(_bytes(pool[2]), _bytes(before[3]))
    assert tier.num_corrupt_reads == 0
    tier.close()
    # Another run finds both records (the bytes checked), with their salts and tokens.
    again = _tier(tmp_path, _pool(4, dtype, seed=1))
    records = sorted(again.scan(), key=lambda r: r.uid)
    assert records == [_record(2, 1), _record(0, 2, "salt")]
    again.close()


def test_damaged_or_cut_short_slots_are_ignored(tmp_path, caplog):
    pool = _pool(4)
    tier = _tier(tmp_path, pool)
    tier.submit([(0, 0), (1, 1), (2, 2)], [_record(0, 1), _record(1, 2), _record(2, 3)], [], None)
    tier.drain()
    path, slot_bytes = tier.path, tier.slot_bytes
    tier.close()
    with open(path, "r+b") as f:
        f.seek(FILE_HEADER_BYTES + 1 * slot_bytes + 4096 + 10)  # slot 1's bytes
        f.write(b"\xff\xfe")
        f.seek(FILE_HEADER_BYTES + 2 * slot_bytes + 20)  # slot 2's header
        f.write(b"\x00" * 8)
    with caplog.at_level(logging.WARNING):
        again = _tier(tmp_path, _pool(4))
        records = again.scan()
    assert [r.uid for r in records] == [1]
    assert "2 slot(s)" in caplog.text and "damaged" in caplog.text
    again.close()


def test_another_models_file_is_started_afresh(tmp_path, caplog):
    tier = _tier(tmp_path, _pool(4))
    tier.submit([(0, 0)], [_record(0, 1)], [], None)
    tier.drain()
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
    with pytest.raises(RuntimeError, match="in use by another process"):
        _tier(tmp_path, _pool(4))
    tier.close()
    _tier(tmp_path, _pool(4)).close()  # free again once closed


def test_fewer_slots_keep_the_lower_ones(tmp_path):
    tier = _tier(tmp_path, _pool(4))
    tier.submit([(0, 0), (1, 3)], [_record(0, 1), _record(3, 2)], [], None)
    tier.drain()
    tier.close()
    smaller = _tier(tmp_path, _pool(4), num_blocks=2)
    assert [r.disk_block for r in smaller.scan()] == [0]
    assert os.path.getsize(smaller.path) == FILE_HEADER_BYTES + 2 * smaller.slot_bytes
    smaller.close()


def test_a_slot_changed_after_start_is_reported_on_read(tmp_path, caplog):
    pool = _pool(4)
    tier = _tier(tmp_path, pool)
    tier.submit([(0, 1)], [_record(1, 1)], [], None)
    tier.drain()
    with open(tier.path, "r+b") as f:
        f.seek(FILE_HEADER_BYTES + tier.slot_bytes + 4096)
        f.write(b"\x01\x02\x03")
    with caplog.at_level(logging.ERROR):
        tier.submit([], [], [(1, 2)], None)
        tier.drain()
    assert tier.num_corrupt_reads == 1 and "no longer holds" in caplog.text
    tier.close()
