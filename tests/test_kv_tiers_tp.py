"""KV tiers under tensor parallelism on CPUs (2 ranks over gloo): each rank saves and loads its
own shard of every block (its CPU pool, its disk file), following the one scheduler's plan.
Greedy tokens equal TP=1 without tiers, through the CPU and disk tiers and a restart; a block
whole on one rank only (the other's slot damaged: its header, or its bytes, found when read)
is not served."""

from __future__ import annotations

import logging

import pytest
from engine_utils import make_hf_model
from test_kv_tiers_engine import COMMON, GIB, conversations, run_turns

from pydaemon.entrypoints.llm import LLM
from pydaemon.worker.kv_disk_tier import FILE_HEADER_BYTES, SLOT_HEADER_BYTES


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    # 4 query / 2 KV heads: one KV head per rank, so each rank's block is half the bytes.
    path, _ = make_hf_model(
        tmp_path_factory.mktemp("tiers_tp") / "llama", hidden_size=32, num_heads=4, num_kv_heads=2
    )
    return str(path)


def test_tp2_tiers_and_restart_match_tp1(model_dir, tmp_path, caplog):
    convs = conversations(num=4)
    reference = run_turns(LLM(model_dir, **COMMON), convs)
    # The sizes are over both ranks (as vLLM's): each holds half. A block of this model on both
    # ranks: 2 layers x 2 (K, V) x 2 KV heads x 8 tokens x 8 dims x 4 bytes.
    block = 2 * 2 * 2 * 8 * 8 * 4
    kw = dict(
        COMMON,
        tensor_parallel_size=2,
        swap_space=0,
        kv_offloading_size=8 * block / GIB,
        kv_offloading_dir=str(tmp_path),
        kv_offloading_disk_size=100 * block / GIB,
    )
    llm = LLM(model_dir, **kw)
    assert run_turns(llm, convs) == reference
    stats = llm.engine.get_stats().kv_tiers
    assert stats.cpu_hit_tokens > 0 and stats.disk_hit_tokens > 0
    assert stats.gpu_to_cpu_bytes % block == 0  # counted over both ranks
    num_on_disk = stats.num_disk_cached_blocks
    llm.engine.shutdown()
    files = sorted(tmp_path.glob("*/rank*-of-2.kvtier"))
    assert [f.name for f in files] == ["rank0-of-2.kvtier", "rank1-of-2.kvtier"]

    llm = LLM(model_dir, **kw)
    restored = llm.engine.get_stats().kv_tiers.num_restored_disk_blocks
    assert 0 < restored <= num_on_disk
    assert run_turns(llm, convs) == reference
    assert llm.engine.get_stats().kv_tiers.disk_hit_tokens > 0
    llm.engine.shutdown()

    # Rank 1's copy of slot 1 has a damaged header: the block is whole on rank 0 only, so no
    # rank offers it. Rank 1's copy of slot 0 has damaged bytes: its read fails on rank 1
    # alone, the ranks agree it failed, and the block is computed again on both.
    slot_bytes = SLOT_HEADER_BYTES + 4096  # a block's bytes, rounded up to 4 KiB
    with open(files[1], "r+b") as f:
        f.seek(FILE_HEADER_BYTES + SLOT_HEADER_BYTES + 3)
        f.write(b"\x00\xff\x00")
        f.seek(FILE_HEADER_BYTES + slot_bytes + 100)
        f.write(b"\x00\xff\x00")
    with caplog.at_level(logging.WARNING):
        llm = LLM(model_dir, **kw)
    assert llm.engine.get_stats().kv_tiers.num_restored_disk_blocks < restored
    assert run_turns(llm, convs) == reference
    assert llm.engine.get_stats().kv_tiers.num_failed_disk_reads >= 1
    llm.engine.shutdown()
