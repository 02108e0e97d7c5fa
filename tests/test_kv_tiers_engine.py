"""KV tiers through the offline LLM on the CPU build: a multi-turn workload on a GPU pool far too
small for it, so that prefixes are evicted to the CPU tier (a second host pool here), to disk,
and come back. Greedy tokens equal those of the same engine without tiers, through every path:
saves, loads, ahead saves, disk writes and reads, a restart that finds the disk tier again,
swap preemption, async scheduling, an FP8 cache; and no block is left behind in any tier."""

from __future__ import annotations

import logging
import random

import pytest
from engine_utils import make_hf_model

from pydaemon import _core
from pydaemon.entrypoints.llm import LLM
from pydaemon.sampling_params import SamplingParams
from pydaemon.worker.kv_disk_tier import FILE_HEADER_BYTES, SLOT_HEADER_BYTES

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
# A block of the tiny model: 2 layers x 2 (K, V) x 1 KV head x 8 tokens x 16 dims x 4 bytes.
BLOCK_BYTES = 2 * 2 * 1 * 8 * 16 * 4
GIB = 1 << 30
COMMON = dict(
    device="cpu", dtype="float32", block_size=8, num_kv_blocks=16, max_num_seqs=4, watermark=0.0
)


def tiers(cpu_blocks: int, disk_blocks: int = 0, directory=None, swap_blocks: int = 0) -> dict:
    """The tiers' settings in blocks; the host pool holds the swap space too (swap_space),
    which the CPU tier also uses while no preempted sequence needs it."""
    kw = dict(
        kv_offloading_size=cpu_blocks * BLOCK_BYTES / GIB,
        kv_offloading_backend="native",
        swap_space=swap_blocks * BLOCK_BYTES / GIB,
    )
    if disk_blocks:
        kw.update(
            kv_offloading_dir=str(directory),
            kv_offloading_disk_size=disk_blocks * BLOCK_BYTES / GIB,
        )
    return kw


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path, _ = make_hf_model(
        tmp_path_factory.mktemp("tiers") / "llama", hidden_size=32, num_heads=2, num_kv_heads=1
    )
    return str(path)


def conversations(num: int = 6, turns: int = 3, seed: int = 0) -> list[list[list[int]]]:
    """conversations[c][t]: the prompt of turn t of conversation c, which extends turn t-1's
    (a 20-token history, then 9-token turns: full blocks come back turn after turn)."""
    rng = random.Random(seed)
    out = []
    for _ in range(num):
        history = [rng.randrange(3, 250) for _ in range(20)]
        prompts = []
        for _ in range(turns):
            history = history + [rng.randrange(3, 250) for _ in range(9)]
            prompts.append(list(history))
        out.append(prompts)
    return out


def run_turns(llm: LLM, convs) -> list[list[list[int]]]:
    """Turn by turn, every conversation at once: the later turns find their history evicted."""
    outputs = []
    for turn in range(len(convs[0])):
        prompts = [c[turn] for c in convs]
        results = llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY, use_tqdm=False)
        outputs.append([r.outputs[0].token_ids for r in results])
    return outputs


def assert_nothing_left(llm: LLM) -> None:
    """Every block of every pool is free, but for the pins of the last two steps' copies."""
    bm = llm.engine.core.scheduler.block_manager
    assert bm.seq_ids() == []
    for device in (_core.Device.GPU, _core.Device.CPU, _core.Device.DISK):
        total = bm.num_total_blocks(device)
        assert bm.num_free_blocks(device) + bm.num_pinned_blocks(device) == total, device
    assert bm.num_pinned_blocks(_core.Device.GPU) == 0


@pytest.fixture(scope="module")
def reference(model_dir):
    """The same engine without tiers (prefix caching on): what every run must produce."""
    llm = LLM(model_dir, **COMMON)
    out = run_turns(llm, conversations())
    llm.engine.shutdown()
    return out


def test_cpu_tier_saves_and_loads_exactly(model_dir, reference):
    llm = LLM(model_dir, **COMMON, **tiers(cpu_blocks=64))
    assert run_turns(llm, conversations()) == reference
    stats = llm.engine.get_stats().kv_tiers
    assert stats.cpu_hit_tokens > 0 and stats.gpu_to_cpu_bytes > 0
    assert stats.cpu_to_gpu_bytes == stats.cpu_hit_tokens // 8 * BLOCK_BYTES
    assert stats.num_cpu_cached_blocks > 0 and stats.num_disk_blocks == 0
    assert_nothing_left(llm)
    llm.engine.shutdown()


def test_async_scheduling_and_swap_preemption_with_tiers(model_dir):
    convs = conversations(seed=1)
    kw = dict(COMMON, num_kv_blocks=12, preemption_mode="swap", max_num_seqs=4)
    ref = run_turns(LLM(model_dir, **kw), convs)
    llm = LLM(model_dir, **kw, async_scheduling=True, **tiers(cpu_blocks=24, swap_blocks=16))
    assert run_turns(llm, convs) == ref
    stats = llm.engine.get_stats()
    assert stats.kv_tiers.cpu_hit_tokens > 0
    assert stats.num_swapped_out_blocks > 0  # swap and the tier shared the host pool
    assert_nothing_left(llm)
    llm.engine.shutdown()


def test_disk_tier_then_a_restart_finds_it_again(model_dir, reference, tmp_path, caplog):
    kw = dict(COMMON, **tiers(cpu_blocks=8, disk_blocks=200, directory=tmp_path))
    llm = LLM(model_dir, **kw)
    assert run_turns(llm, conversations()) == reference
    stats = llm.engine.get_stats().kv_tiers
    assert stats.disk_hit_tokens > 0 and stats.cpu_to_disk_bytes > 0
    assert stats.disk_to_cpu_bytes == stats.disk_hit_tokens // 8 * BLOCK_BYTES
    num_on_disk = stats.num_disk_cached_blocks
    assert_nothing_left(llm)
    llm.engine.shutdown()  # finishes the writes in flight, closes the file

    # A restarted daemon, same model and settings: its prefix cache is on disk from the start.
    llm = LLM(model_dir, **kw)
    stats = llm.engine.get_stats().kv_tiers
    # (A block whose parent never reached the disk, the CPU tier being full of pinned blocks
    # when it was evicted, cannot be reached: left out.)
    assert 0 < stats.num_restored_disk_blocks <= num_on_disk
    assert run_turns(llm, conversations()) == reference
    assert llm.engine.get_stats().kv_tiers.disk_hit_tokens >= 8 * len(conversations())
    llm.engine.shutdown()

    # Damaged slots are not served: a damaged header is ignored at start, damaged bytes fail
    # their read (checked then): the block is computed again.
    (path,) = tmp_path.glob("*/rank0-of-1.kvtier")
    slot_bytes = SLOT_HEADER_BYTES + 4096  # a block's bytes, rounded up to 4 KiB
    with open(path, "r+b") as f:
        f.seek(FILE_HEADER_BYTES + SLOT_HEADER_BYTES + 5)  # slot 0's bytes
        f.write(b"\xde\xad")
        f.seek(FILE_HEADER_BYTES + slot_bytes + 100)  # slot 1's header
        f.write(b"\xde\xad")
    with caplog.at_level(logging.WARNING):
        llm = LLM(model_dir, **kw)
        assert "damaged" in caplog.text
        assert llm.engine.get_stats().kv_tiers.num_restored_disk_blocks < num_on_disk
        assert run_turns(llm, conversations()) == reference
    assert "no longer holds what was written" in caplog.text
    assert llm.engine.get_stats().kv_tiers.num_failed_disk_reads >= 1
    llm.engine.shutdown()

    # Another model's settings (block size) never see these blocks.
    other = LLM(model_dir, **dict(kw, block_size=16))
    assert other.engine.get_stats().kv_tiers.num_restored_disk_blocks == 0
    other.engine.shutdown()


def test_fp8_cache_keeps_its_bytes_through_the_tiers(model_dir, tmp_path):
    convs = conversations(seed=2)
    kw = dict(COMMON, kv_cache_dtype="fp8")
    ref = run_turns(LLM(model_dir, **kw), convs)
    fp8_block = BLOCK_BYTES // 4  # one byte an element
    size = dict(
        swap_space=0,
        kv_offloading_size=8 * fp8_block / GIB,
        kv_offloading_dir=str(tmp_path),
        kv_offloading_disk_size=200 * fp8_block / GIB,
    )
    llm = LLM(model_dir, **kw, **size)
    assert run_turns(llm, convs) == ref
    stats = llm.engine.get_stats().kv_tiers
    assert stats.cpu_hit_tokens > 0 and stats.disk_hit_tokens > 0
    llm.engine.shutdown()


def test_abort_during_a_load_then_the_prefix_again(model_dir, reference):
    """A request aborted in the step its prefix loads: nothing is lost, and the next request
    with that prefix still gets exactly the reference tokens."""
    from pydaemon.generate_request import GenerateRequest

    convs = conversations()
    llm = LLM(model_dir, **COMMON, **tiers(cpu_blocks=64))
    run_turns(llm, [c[:1] for c in convs])  # first turns: their blocks end up in the CPU tier
    engine = llm.engine
    loaded_before = engine.get_stats().kv_tiers.cpu_to_gpu_bytes
    engine.add_request(GenerateRequest("doomed", convs[0][1], GREEDY))
    engine.step()  # admitted: its history loads from the CPU tier while the step runs
    assert engine.get_stats().kv_tiers.cpu_to_gpu_bytes > loaded_before
    assert engine.abort_request("doomed")
    while engine.has_unfinished_requests():
        engine.step()
    assert_nothing_left(llm)
    again = llm.generate(prompt_token_ids=[convs[0][1]], sampling_params=GREEDY, use_tqdm=False)
    assert again[0].outputs[0].token_ids == reference[1][0]
    llm.engine.shutdown()


DISK = dict(kv_offloading_size=1.0, kv_offloading_dir="/tmp/x")
BAD_SETTINGS = [
    (dict(kv_offloading_size=-1.0), "kv_offloading_size must be a number of GiB >= 0"),
    (dict(kv_offloading_size=float("nan")), "kv_offloading_size must be a number of GiB"),
    (dict(kv_offloading_size=float("inf")), "kv_offloading_size must be a number of GiB"),
    (dict(kv_offloading_size=1e12), r"<= 1048576 \(--kv-offloading-size"),
    *[
        (
            dict(DISK, kv_offloading_disk_size=size),
            r"kv_offloading_disk_size must be a number of GiB > 0.*--kv-offloading-disk-size",
        )
        for size in (float("nan"), float("inf"), -1.0, 0.0, 1e12)
    ],
    (dict(DISK, kv_offloading_dir="/tmp/\0x", kv_offloading_disk_size=1.0), "NUL byte"),
    (dict(kv_offloading_size=1.0, kv_offloading_backend="lmcache"), "must be 'native'"),
    (dict(kv_offloading_backend="native"), "needs kv_offloading_size"),
    (dict(kv_offloading_dir="/tmp/x", kv_offloading_disk_size=1.0), "behind the CPU tier"),
    (dict(DISK), "needs kv_offloading_disk_size"),
    (dict(kv_offloading_size=1.0, kv_offloading_disk_size=1.0), "needs kv_offloading_dir"),
    (dict(kv_offloading_size=1.0, enable_prefix_caching=False), "enable_prefix_caching"),
    (
        dict(DISK, kv_offloading_disk_size=1.0, kv_cache_dtype="fp8", calculate_kv_scales=True),
        "measured anew each run",
    ),
]


@pytest.mark.parametrize(("kwargs", "match"), BAD_SETTINGS)
def test_bad_settings_are_refused_by_name(kwargs, match):
    from pydaemon.config.engine import EngineConfig

    with pytest.raises(ValueError, match=match):
        EngineConfig(**kwargs)


def test_a_tier_smaller_than_a_block_is_refused(model_dir):
    with pytest.raises(ValueError, match="holds no KV block"):
        LLM(model_dir, **COMMON, kv_offloading_size=BLOCK_BYTES / 2 / GIB)
