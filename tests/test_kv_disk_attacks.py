"""The disk tier under attack and misuse (issue 55, items 1-5), through the offline LLM on the
CPU build: greedy tokens with the tiers equal those without, whatever is done to the tier's
files, the disk or the model's weights; a path that is not safe to use is refused at start with
an error naming the flag, nothing followed, written or left behind."""

from __future__ import annotations

import errno
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from engine_utils import make_hf_model
from test_kv_tiers_engine import BLOCK_BYTES, COMMON, conversations, run_turns, tiers

from pydaemon.entrypoints.llm import LLM
from pydaemon.worker import kv_disk_tier
from pydaemon.worker.kv_disk_tier import FILE_HEADER_BYTES

ROOT = Path(__file__).resolve().parent.parent
OUTSIDE = b"an outside file the tier must never touch\n" * 3  # 129 bytes


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path, _ = make_hf_model(
        tmp_path_factory.mktemp("attacks") / "llama", hidden_size=32, num_heads=2, num_kv_heads=1
    )
    return str(path)


@pytest.fixture(scope="module")
def reference(model_dir):
    llm = LLM(model_dir, **COMMON)
    out = run_turns(llm, conversations())
    llm.engine.shutdown()
    return out


def disk_kw(directory, disk_blocks: int = 200) -> dict:
    return dict(COMMON, **tiers(cpu_blocks=8, disk_blocks=disk_blocks, directory=directory))


def tier_file(directory) -> Path:
    (path,) = Path(directory).glob("*/rank0-of-1.kvtier")
    return path


def listing(directory) -> list[tuple[str, int]]:
    return sorted((str(p), p.lstat().st_mode) for p in Path(directory).rglob("*"))


def one_run(model_dir, directory, turns=None) -> None:
    llm = LLM(model_dir, **disk_kw(directory))
    run_turns(llm, conversations() if turns is None else turns)
    llm.engine.shutdown()


# ---- 1. never a symlink, never another user's or a shared folder ------------------------------
def test_a_symlink_planted_for_the_tier_file_is_refused_and_its_target_untouched(
    model_dir, tmp_path
):
    tier_dir, outside = tmp_path / "tier", tmp_path / "outside.txt"
    one_run(model_dir, tier_dir, [c[:1] for c in conversations()])
    path = tier_file(tier_dir)
    outside.write_bytes(OUTSIDE)
    path.unlink()
    path.symlink_to(outside)
    with pytest.raises(ValueError, match=r"--kv-offloading-dir: .* is a symbolic link"):
        LLM(model_dir, **disk_kw(tier_dir))
    assert outside.read_bytes() == OUTSIDE
    assert path.is_symlink()


def test_a_symlinked_model_folder_is_refused_and_nothing_created_outside(model_dir, tmp_path):
    tier_dir, outside = tmp_path / "tier", tmp_path / "outside"
    one_run(model_dir, tier_dir, [c[:1] for c in conversations()])
    folder = tier_file(tier_dir).parent
    shutil.rmtree(folder)
    outside.mkdir(mode=0o700)
    folder.symlink_to(outside, target_is_directory=True)
    with pytest.raises(ValueError, match=r"--kv-offloading-dir: .* is a symbolic link"):
        LLM(model_dir, **disk_kw(tier_dir))
    assert list(outside.iterdir()) == []


@pytest.mark.parametrize("attack", ["group-writable", "world-writable", "another-owner"])
def test_a_folder_others_can_write_or_own_is_refused(model_dir, tmp_path, attack):
    tier_dir = tmp_path / "tier"
    tier_dir.mkdir(mode=0o700)
    if attack == "another-owner":
        if os.geteuid() != 0:
            pytest.skip("needs root to give the folder to another user")
        os.chown(tier_dir, 65534, 65534)
        match = "is owned by uid 65534"
    else:
        tier_dir.chmod(0o770 if attack == "group-writable" else 0o777)
        match = r"may be written by its group or by others.*chmod go-w"
    with pytest.raises(ValueError, match=f"--kv-offloading-dir: .*{match}"):
        LLM(model_dir, **disk_kw(tier_dir))
    assert list(tier_dir.iterdir()) == []


# ---- 2. never serve what the disk no longer holds; a full disk degrades cleanly -------------
@pytest.mark.parametrize("attack", ["overwritten", "truncated"])
def test_a_tier_file_changed_under_the_daemon_is_never_served(
    model_dir, reference, tmp_path, caplog, attack
):
    convs = conversations()
    llm = LLM(model_dir, **disk_kw(tmp_path))
    outputs = run_turns(llm, [c[:1] for c in convs])  # the first turns fill the disk tier
    path = tier_file(tmp_path)
    size = path.stat().st_size
    if attack == "overwritten":  # every slot, headers included, with other bytes
        with open(path, "r+b") as f:
            f.seek(FILE_HEADER_BYTES)
            f.write(os.urandom(size - FILE_HEADER_BYTES))
    else:
        os.truncate(path, FILE_HEADER_BYTES)
    with caplog.at_level(logging.WARNING):
        later = run_turns(llm, [c[1:] for c in convs])
    assert outputs + later == reference
    stats = llm.engine.get_stats().kv_tiers
    assert stats.num_failed_disk_reads > 0 and stats.disk_hit_tokens > 0
    lines = [r for r in caplog.records if "did not hold" in r.message or "no longer" in r.message]
    assert len(lines) <= 2  # the first, then a sum at most once a minute
    llm.engine.shutdown()


def test_a_full_disk_is_reported_once_and_the_tier_stops_writing(
    model_dir, reference, tmp_path, monkeypatch, caplog
):
    real, num_writes = kv_disk_tier._pwrite_all, []

    def fills_up(fd, data, offset):
        if offset >= FILE_HEADER_BYTES:  # a slot's (not the key's)
            num_writes.append(offset)
            if len(num_writes) > 3 * 20:  # 20 blocks fit (3 writes a block), then ENOSPC
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real(fd, data, offset)

    monkeypatch.setattr(kv_disk_tier, "_pwrite_all", fills_up)
    llm = LLM(model_dir, **disk_kw(tmp_path))
    with caplog.at_level(logging.WARNING):
        assert run_turns(llm, conversations()) == reference
    stats = llm.engine.get_stats().kv_tiers
    assert stats.are_disk_writes_stopped and stats.num_failed_disk_writes >= 1
    assert stats.num_disk_cached_blocks <= 20
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and "No space left on device" in errors[0].message
    assert len(num_writes) == 3 * 20 + 1  # no write tried after the error
    again = run_turns(llm, conversations())  # still serving, from the blocks it has
    assert again == reference
    llm.engine.shutdown()


# ---- 3. the model by its content ---------------------------------------------------------------
def _twin_models(tmp_path) -> tuple[Path, Path]:
    """Two checkpoints with the same config.json and model.safetensors names, sizes and
    mtimes, but other weights."""
    a, _ = make_hf_model(tmp_path / "a" / "llama", hidden_size=32, num_heads=2, num_kv_heads=1)
    b, _ = make_hf_model(
        tmp_path / "b" / "llama", hidden_size=32, num_heads=2, num_kv_heads=1, seed=1
    )
    for name in ("config.json", "model.safetensors"):
        fa, fb = a / name, b / name
        assert fa.stat().st_size == fb.stat().st_size
        os.utime(fb, ns=(fa.stat().st_atime_ns, fa.stat().st_mtime_ns))
    assert (a / "config.json").read_bytes() == (b / "config.json").read_bytes()
    assert (a / "model.safetensors").read_bytes() != (b / "model.safetensors").read_bytes()
    return a, b


def test_twin_checkpoints_never_share_blocks(tmp_path, caplog):
    a, b = _twin_models(tmp_path)
    convs = conversations(num=4)
    b_reference = run_turns(LLM(str(b), **COMMON), convs)
    tier_dir = tmp_path / "tier"
    with caplog.at_level(logging.INFO):
        llm = LLM(str(a), **disk_kw(tier_dir))
    assert "hashing 2 weight file(s)" in caplog.text
    run_turns(llm, convs)
    assert llm.engine.get_stats().kv_tiers.num_disk_cached_blocks > 0
    llm.engine.shutdown()
    caplog.clear()
    with caplog.at_level(logging.INFO):  # A again: its hashes come from the cache
        llm = LLM(str(a), **disk_kw(tier_dir))
    assert "hashing" not in caplog.text
    assert llm.engine.get_stats().kv_tiers.num_restored_disk_blocks > 0
    llm.engine.shutdown()

    # B from its own directory over A's tier: none of A's blocks.
    a_folders = set(tier_dir.iterdir())
    llm = LLM(str(b), **disk_kw(tier_dir))
    assert llm.engine.get_stats().kv_tiers.num_restored_disk_blocks == 0
    assert run_turns(llm, convs) == b_reference
    llm.engine.shutdown()
    (b_folder,) = set(tier_dir.iterdir()) - a_folders
    shutil.rmtree(b_folder)  # only A's blocks are left

    # B's weights copied into A's files in place, A's mtimes put back: the same names, sizes,
    # inodes and mtimes, but the change time moved, so the files are hashed again.
    for name in ("config.json", "model.safetensors"):
        st = (a / name).stat()
        with open(a / name, "r+b") as f:
            f.write((b / name).read_bytes())
        os.utime(a / name, ns=(st.st_atime_ns, st.st_mtime_ns))
        assert (a / name).stat().st_ino == st.st_ino
    llm = LLM(str(a), **disk_kw(tier_dir))
    assert llm.engine.get_stats().kv_tiers.num_restored_disk_blocks == 0
    assert run_turns(llm, convs) == b_reference
    llm.engine.shutdown()


# ---- 4. a forged file is a miss ---------------------------------------------------------------
def test_forged_slots_at_restart_are_never_served(model_dir, reference, tmp_path):
    """Every slot's bytes replaced by another block's and every checksum recomputed as a
    forger without the tier's key can (the MACs under a guessed key)."""
    import hmac

    one_run(model_dir, tmp_path)
    path = tier_file(tmp_path)
    data = bytearray(path.read_bytes())
    slot_bytes, header_bytes = 4096 + 4096, 4096
    num_slots = (len(data) - FILE_HEADER_BYTES) // slot_bytes
    donor = bytes(data[FILE_HEADER_BYTES + header_bytes : FILE_HEADER_BYTES + slot_bytes])
    for slot in range(1, num_slots):
        start = FILE_HEADER_BYTES + slot * slot_bytes
        if data[start : start + 8] != kv_disk_tier.SLOT_MAGIC:
            continue
        data[start + header_bytes : start + slot_bytes] = donor  # slot 0's bytes
        header = data[start : start + header_bytes]
        mac = hmac.new(bytes(32), bytes(header[: header_bytes - 64]), "sha256")
        mac.update(donor[:BLOCK_BYTES])
        header[header_bytes - 64 : header_bytes - 32] = mac.digest()
        header[header_bytes - 32 :] = hmac.digest(bytes(32), bytes(header[:-32]), "sha256")
        data[start : start + header_bytes] = header
    path.write_bytes(bytes(data))
    llm = LLM(model_dir, **disk_kw(tmp_path))
    assert llm.engine.get_stats().kv_tiers.num_restored_disk_blocks <= 1  # slot 0 alone
    assert run_turns(llm, conversations()) == reference
    llm.engine.shutdown()


# ---- 5. start-up on paths and sizes that cannot work --------------------------------------------
def _fifo(path: Path) -> Path:
    os.mkfifo(path, 0o600)
    return path


@pytest.mark.parametrize(
    ("attack", "match"),
    [
        ("dir-is-a-file", r"--kv-offloading-dir .*dir: is not a directory"),
        ("dir-is-a-fifo", r"--kv-offloading-dir .*dir: is not a directory"),
        ("tier-file-is-a-fifo", r"--kv-offloading-dir: .*rank0-of-1.kvtier is a FIFO"),
        ("tier-file-is-a-directory", r"--kv-offloading-dir: .*rank0-of-1.kvtier: is a directory"),
        ("tier-file-is-a-hard-link", r"--kv-offloading-dir: .*has 2 hard links"),
        ("disk-beyond-the-books", r"--kv-offloading-disk-size.*more than 4194304 blocks"),
        ("cpu-tier-larger-than-memory", r"--kv-offloading-size.*more than this host's memory"),
    ],
)
def test_start_up_on_what_cannot_work_is_refused_by_name_leaving_nothing(
    model_dir, tmp_path, attack, match
):
    tier_dir = tmp_path / "dir"
    kw = disk_kw(tier_dir)
    if attack == "dir-is-a-file":
        tier_dir.write_bytes(OUTSIDE)
    elif attack == "dir-is-a-fifo":
        _fifo(tier_dir)
    elif attack.startswith("tier-file"):
        one_run(model_dir, tier_dir, [conversations()[0][:1]])
        path = tier_file(tier_dir)
        path.unlink()
        if attack == "tier-file-is-a-fifo":
            _fifo(path)
        elif attack == "tier-file-is-a-directory":
            path.mkdir(mode=0o700)
        else:
            outside = tmp_path / "outside"
            outside.write_bytes(OUTSIDE)
            os.link(outside, path)
    elif attack == "disk-beyond-the-books":
        kw.update(kv_offloading_disk_size=10_000.0, kv_offloading_dir=str(tmp_path / "a" / "b"))
    else:
        kw.update(kv_offloading_size=1 << 19)  # 512 TiB
    before = listing(tmp_path)
    with pytest.raises(ValueError, match=match):
        LLM(model_dir, **kw)
    assert listing(tmp_path) == before  # nothing created, nothing removed
    if attack == "tier-file-is-a-hard-link":
        assert (tmp_path / "outside").read_bytes() == OUTSIDE


def test_the_daemon_refuses_a_bad_tier_by_name_without_a_traceback(model_dir, tmp_path):
    fifo = _fifo(tmp_path / "fifo")
    common = [sys.executable, "-m", "pydaemon", "serve", "--model", model_dir, "--port", "0"]
    common += ["--device", "cpu", "--kv-offloading-size", "0.001"]
    for flags, expected in (
        (
            ["--kv-offloading-dir", str(fifo), "--kv-offloading-disk-size", "0.01"],
            f"start-up failed: --kv-offloading-dir {fifo}: is not a directory",
        ),
        (
            ["--kv-offloading-dir", str(tmp_path / "t"), "--kv-offloading-disk-size", "nan"],
            "--kv-offloading-disk-size must be a number of GiB > 0",  # the flag, issue 55
        ),
    ):
        run = subprocess.run(common + flags, capture_output=True, text=True, cwd=ROOT, timeout=120)
        assert run.returncode in (1, 2), run.stderr  # a start-up failure; a bad flag
        assert expected in run.stderr and "Traceback" not in run.stderr, run.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fifo"]
