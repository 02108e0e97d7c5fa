"""KV tiers on the GPU: the copy stream's order against the compute stream (a save sees the
K/V written before it and is never overtaken by the block's reuse; a load is read by the next
step; the disk tier's I/O thread waits for the copies it writes out), FP8 blocks kept as bytes,
and the engine's greedy tokens with tiers equal to those without (CPU tier, disk tier, a
restart; async scheduling and CUDA graphs on, as by default)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from engine_utils import make_hf_model  # noqa: E402

from pydaemon import LLM, SamplingParams  # noqa: E402
from pydaemon._core import Device  # noqa: E402
from pydaemon.core.disk_blocks import DiskBlockRecord  # noqa: E402
from pydaemon.core.sched.scheduler_output import SchedulerOutput  # noqa: E402
from pydaemon.quantization.kv_cache_fp8 import FP8_DTYPE  # noqa: E402
from pydaemon.worker.kv_disk_tier import DiskTier  # noqa: E402
from pydaemon.worker.kv_transfer import KVTransfer  # noqa: E402

SHAPE = (2, 2, 1, 16, 64)  # [layers, 2, kv heads, block size, head dim]


def _caches(dtype=torch.bfloat16, num_gpu: int = 8, num_cpu: int = 8):
    gpu = torch.zeros(num_gpu, *SHAPE, device="cuda", dtype=dtype)
    cpu = torch.zeros(num_cpu, *SHAPE, dtype=dtype).pin_memory()
    return gpu, cpu


def _busy_compute() -> None:
    """Keeps the compute stream busy for a while, so that a missing wait would show."""
    big = torch.randn(4096, 4096, device="cuda")
    for _ in range(20):
        big = big @ big.T / 4096


def test_saves_and_loads_are_ordered_with_compute_by_events():
    gpu, cpu = _caches()
    transfer = KVTransfer(gpu, cpu, None, use_kernels=True)
    _busy_compute()
    gpu[2].fill_(7.0)  # queued after the matmuls on the compute stream
    gpu[3].fill_(3.0)
    # Step 1: block 2 evicted (saved before the step's writes), block 3 saved ahead.
    transfer.move(
        SchedulerOutput(blocks_to_save_to_cpu=[(2, 5)], blocks_to_save_ahead_to_cpu=[(3, 4)])
    )
    gpu[2].fill_(-1.0)  # the step reuses block 2 only after its save
    # Step 2: block 3 is reused (after the ahead save); block 5 comes back into block 6.
    transfer.move(SchedulerOutput(blocks_to_load_from_cpu=[(5, 6)]))
    gpu[3].fill_(-3.0)
    # Step 3: reads block 6 (after the load).
    transfer.move(SchedulerOutput())
    seen = gpu[6].clone()
    torch.cuda.synchronize()
    assert torch.equal(cpu[5], torch.full_like(cpu[5], 7.0))
    assert torch.equal(cpu[4], torch.full_like(cpu[4], 3.0))
    assert torch.equal(seen.cpu(), torch.full_like(cpu[5], 7.0))
    assert float(gpu[2].max()) == -1.0 and float(gpu[3].max()) == -3.0


def test_fp8_blocks_are_saved_and_loaded_as_bytes():
    gpu = torch.randn(8, *SHAPE, device="cuda").to(FP8_DTYPE)
    cpu = torch.zeros(8, *SHAPE, dtype=FP8_DTYPE).pin_memory()
    before = gpu.clone()
    transfer = KVTransfer(gpu, cpu, None, use_kernels=True)
    transfer.move(SchedulerOutput(blocks_to_save_to_cpu=[(1, 0), (2, 1), (3, 2)]))
    transfer.move(SchedulerOutput(blocks_to_load_from_cpu=[(0, 5), (2, 7)]))
    transfer.move(SchedulerOutput())
    torch.cuda.synchronize()
    assert torch.equal(cpu[:3].view(torch.uint8), before[1:4].cpu().view(torch.uint8))
    assert torch.equal(gpu[5].view(torch.uint8), before[1].view(torch.uint8))
    assert torch.equal(gpu[7].view(torch.uint8), before[3].view(torch.uint8))


def test_disk_writes_wait_for_the_saves_they_write_out(tmp_path):
    gpu, cpu = _caches(num_cpu=4)
    disk = DiskTier(tmp_path, {"t": 1}, 4, cpu, block_size=16)
    transfer = KVTransfer(gpu, cpu, disk, use_kernels=True)
    _busy_compute()
    gpu[1].fill_(5.0)
    record = DiskBlockRecord(2, 1, 0, 123, "", tuple(range(16)))
    # One step: save block 1 into CPU 0 and write CPU 0 to slot 2 (after the save).
    transfer.move(
        SchedulerOutput(
            blocks_to_save_to_cpu=[(1, 0)],
            blocks_to_write_to_disk=[(0, 2)],
            disk_write_records=[record],
        )
    )
    # Next step: read slot 2 into CPU 3 (the read names the block the slot must hold); the one
    # after: load it into GPU block 6.
    transfer.move(SchedulerOutput(blocks_to_read_from_disk=[(2, 3)], disk_read_records=[record]))
    transfer.move(SchedulerOutput(blocks_to_load_from_cpu=[(3, 6)]))
    transfer.move(SchedulerOutput())
    transfer.synchronize()
    assert torch.equal(cpu[3], torch.full_like(cpu[3], 5.0))
    assert torch.equal(gpu[6].cpu(), torch.full_like(cpu[3], 5.0))
    transfer.close()


# ---------------------------------------------------------------- the engine on the GPU

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
GIB = 1 << 30


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path, _ = make_hf_model(
        tmp_path_factory.mktemp("tiers_gpu"),
        hidden_size=512,
        num_heads=8,
        num_kv_heads=2,
        num_layers=2,
        vocab_size=512,
        seed=2,
    )
    return str(path)


def _conversations(num: int = 8, turns: int = 3) -> list[list[list[int]]]:
    gen = torch.Generator().manual_seed(0)
    out = []
    for _ in range(num):
        history = torch.randint(3, 512, (100,), generator=gen).tolist()
        prompts = []
        for _ in range(turns):
            history = history + torch.randint(3, 512, (40,), generator=gen).tolist()
            prompts.append(list(history))
        out.append(prompts)
    return out


def _run(llm: LLM, convs) -> list:
    out = []
    for turn in range(len(convs[0])):
        results = llm.generate(
            prompt_token_ids=[c[turn] for c in convs], sampling_params=GREEDY, use_tqdm=False
        )
        out.append([r.outputs[0].token_ids for r in results])
    return out


def _block_bytes(dtype_bytes: int) -> int:
    return 2 * 2 * 2 * 16 * 64 * dtype_bytes  # layers x (K, V) x KV heads x block x head dim


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_engine_greedy_equal_with_cpu_and_disk_tiers_and_a_restart(
    model_dir, tmp_path, kv_cache_dtype
):
    common = dict(
        device="cuda",
        dtype="float16",
        block_size=16,
        num_kv_blocks=64,  # a turn of 4 conversations fits; the 8 histories (~112 blocks) do not
        max_num_seqs=4,
        watermark=0.0,
        kv_cache_dtype=kv_cache_dtype,
        swap_space=0,
    )
    convs = _conversations()
    ref_llm = LLM(model_dir, **common)
    reference = _run(ref_llm, convs)
    ref_llm.engine.shutdown()
    block = _block_bytes(1 if kv_cache_dtype == "fp8" else 2)
    cpu_only = LLM(model_dir, **common, kv_offloading_size=200 * block / GIB)
    assert _run(cpu_only, convs) == reference
    stats = cpu_only.engine.get_stats().kv_tiers
    assert stats.cpu_hit_tokens > 0 and stats.gpu_to_cpu_bytes > 0
    cpu_only.engine.shutdown()
    tiers = dict(
        kv_offloading_size=24 * block / GIB,
        kv_offloading_dir=str(tmp_path),
        kv_offloading_disk_size=400 * block / GIB,
    )
    llm = LLM(model_dir, **common, **tiers)
    assert _run(llm, convs) == reference
    stats = llm.engine.get_stats().kv_tiers
    assert stats.disk_hit_tokens > 0 and stats.cpu_to_disk_bytes > 0
    bm = llm.engine.block_manager
    assert bm.num_free_blocks(Device.GPU) == bm.num_total_blocks(Device.GPU)
    llm.engine.shutdown()
    restarted = LLM(model_dir, **common, **tiers)
    assert restarted.engine.get_stats().kv_tiers.num_restored_disk_blocks > 0
    assert _run(restarted, convs) == reference
    assert restarted.engine.get_stats().kv_tiers.disk_hit_tokens > 0
    restarted.engine.shutdown()
