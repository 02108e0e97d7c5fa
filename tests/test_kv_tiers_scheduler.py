"""The scheduler with KV tiers, step by step: a prefix evicted from the GPU comes back from the
CPU tier (or the disk tier) through loads in the SchedulerOutput, and the request runs only
once they are readable, without holding up the others; aborts and preemptions during a load
lose no block (exact free counts in every pool). The runner's side is its real InputBatch."""

from __future__ import annotations

import itertools
import logging

import numpy as np

from pydaemon import _core
from pydaemon.core.disk_blocks import DiskTierReport
from pydaemon.core.request import Request, RequestStatus, Sequence
from pydaemon.core.runner_output import ModelRunnerOutput
from pydaemon.core.sched.scheduler import Scheduler
from pydaemon.core.sched.scheduler_config import KVTierConfig, SchedulerConfig
from pydaemon.core.sched.scheduler_output import SchedulerOutput
from pydaemon.core.stop_checker import StopChecker
from pydaemon.lora_request import LoRARequest, is_lora_salt, prefix_cache_salt
from pydaemon.outputs import RequestMetrics
from pydaemon.sampling_params import SamplingParams
from pydaemon.worker.input_batch import InputBatch

BLOCK_SIZE = 4
GPU, CPU, DISK = _core.Device.GPU, _core.Device.CPU, _core.Device.DISK
_arrival = itertools.count()


def make_request(request_id: str, prompt: list[int], max_tokens: int = 1) -> Request:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    request = Request(
        request_id=request_id,
        prompt_token_ids=prompt,
        params=params,
        eos_token_ids={2},
        metrics=RequestMetrics(arrival_time=float(next(_arrival))),
    )
    request.stop_checker = StopChecker(params, request.eos_token_ids)
    request.seqs.append(Sequence.new(0, prompt))
    return request


class Harness:
    def __init__(self, num_gpu_blocks: int, num_cpu_blocks: int, num_disk_blocks: int = 0):
        self.pools = {GPU: num_gpu_blocks, CPU: num_cpu_blocks, DISK: num_disk_blocks}
        self.scheduler = Scheduler(
            SchedulerConfig(
                block_size=BLOCK_SIZE,
                num_gpu_blocks=num_gpu_blocks,
                num_cpu_blocks=num_cpu_blocks,
                max_num_seqs=8,
                max_num_batched_tokens=64,
                max_model_len=64,
                preemption_mode="recompute",
                tiers=KVTierConfig(
                    enable_cpu_tier=True, num_disk_blocks=num_disk_blocks, kv_block_bytes=1000
                ),
            )
        )
        self.bm = self.scheduler.block_manager
        self.batch = InputBatch(8, 64, BLOCK_SIZE)

    def add(self, *requests: Request) -> None:
        for request in requests:
            self.scheduler.add_request(request)

    def step(self, disk_report=None) -> SchedulerOutput:
        """One step; ``disk_report(out)``: the DiskTierReport the runner gives with it."""
        out = self.scheduler.schedule()
        self.batch.update(out)
        runner_output = ModelRunnerOutput()
        if disk_report is not None:
            runner_output.disk_report = disk_report(out)
        if out.num_seqs:
            inputs = self.batch.prepare(out)
            for seq_id in np.asarray(inputs.seq_ids)[inputs.is_sampled].tolist():
                runner_output.seq_ids.append(seq_id)
                runner_output.sampled_token_ids.append([7])
                runner_output.chosen_logprobs.append([-1.0])
                runner_output.logprobs.append([None])
        self.outputs = self.scheduler.update_from_output(out, runner_output)
        return out

    def finish(self) -> None:
        """Steps until every request is done and the last copies' pins are gone (the idle
        steps write the last blocks through to disk); every block of every pool is free then."""
        while self.scheduler.has_unfinished_requests():
            self.step()
        for _ in range(4):
            self.step()
        for device, total in self.pools.items():
            assert self.bm.num_free_blocks(device) == total, device
            assert self.bm.num_pinned_blocks(device) == 0


def _prompt(start: int, length: int) -> list[int]:
    return list(range(start, start + length))


def _evict_into_cpu(h: Harness) -> None:
    """Prompt A (two full blocks cached), then prompt B filling the GPU: A's blocks are
    evicted into the CPU tier."""
    h.add(make_request("a", _prompt(10, 9)))
    h.step()  # a computes its prompt, samples its only token, finishes: 2 blocks cached
    assert h.bm.num_cached_blocks(GPU) == 2
    h.add(make_request("b", _prompt(40, BLOCK_SIZE * h.pools[GPU])))
    out = h.step()
    assert len(out.blocks_to_save_to_cpu) == 2  # a's blocks, evicted before b writes
    assert h.bm.num_cached_blocks(CPU) == 2


def test_cpu_hit_loads_in_one_step_and_runs_in_the_next():
    h = Harness(num_gpu_blocks=6, num_cpu_blocks=8)
    _evict_into_cpu(h)
    h.add(make_request("a2", _prompt(10, 8) + [99]))
    out = h.step()
    seq_id = h.scheduler.requests["a2"].seqs[0].seq_id
    assert len(out.blocks_to_load_from_cpu) == 2
    gpu_blocks = [g for _, g in out.blocks_to_load_from_cpu]
    assert seq_id not in out.num_scheduled_tokens  # its blocks are still loading
    assert h.scheduler.requests["a2"].status == RequestStatus.RUNNING
    out = h.step()
    assert out.num_scheduled_tokens == {seq_id: 1}  # only its last prompt token is computed
    new = out.scheduled_new_seqs[0]
    assert new.num_computed_tokens == 8 and new.block_ids[:2] == gpu_blocks
    assert out.blocks_to_load_from_cpu == []
    stats = h.scheduler.make_stats().kv_tiers
    assert stats.cpu_hit_tokens == 8 and stats.gpu_hit_tokens == 0
    # Saved: a's 2 blocks (evicted by b), then 3 of b's (evicted by a2's 3 blocks).
    assert stats.cpu_to_gpu_bytes == 2 * 1000 and stats.gpu_to_cpu_bytes == 5 * 1000
    h.finish()


def test_a_loading_request_does_not_hold_up_the_batch():
    h = Harness(num_gpu_blocks=8, num_cpu_blocks=8)
    _evict_into_cpu(h)
    c = make_request("c", _prompt(70, 3), max_tokens=4)
    h.add(c)
    h.step()  # c is decoding
    h.add(make_request("a2", _prompt(10, 8) + [99]))
    out = h.step()
    c_id = c.seqs[0].seq_id
    assert out.blocks_to_load_from_cpu and out.num_scheduled_tokens == {c_id: 1}
    h.finish()


def test_disk_hit_reads_then_loads_then_runs():
    h = Harness(num_gpu_blocks=6, num_cpu_blocks=2, num_disk_blocks=8)
    _evict_into_cpu(h)
    # c pushes a's blocks out of the 2-block CPU tier: they stay on disk only.
    h.add(make_request("c", _prompt(70, 9)))
    h.step()
    h.add(make_request("d", _prompt(100, 24)))
    h.step()
    h.step()  # an idle step: the CPU blocks saved by the last one are no longer pinned
    assert h.bm.num_cached_blocks(DISK) == 4
    h.add(make_request("a2", _prompt(10, 8) + [99]))
    out = h.step()
    seq_id = h.scheduler.requests["a2"].seqs[0].seq_id
    assert len(out.blocks_to_read_from_disk) == 2 and out.blocks_to_load_from_cpu == []
    assert seq_id not in out.num_scheduled_tokens
    out = h.step()
    assert len(out.blocks_to_load_from_cpu) == 2  # the read blocks, a step later
    assert seq_id not in out.num_scheduled_tokens
    out = h.step()
    assert out.num_scheduled_tokens == {seq_id: 1}
    assert h.scheduler.make_stats().kv_tiers.disk_hit_tokens == 8
    h.finish()


def _a_on_disk_only(h: Harness) -> None:
    _evict_into_cpu(h)
    # c pushes a's blocks out of the 2-block CPU tier: they stay on disk only.
    h.add(make_request("c", _prompt(70, 9)))
    h.step()
    h.add(make_request("d", _prompt(100, 24)))
    h.step()
    h.step()
    assert h.bm.num_cached_blocks(DISK) == 4


def test_a_failed_disk_read_is_recomputed_never_served():
    """The runner reports that the second block's read did not deliver it (the slot changed
    underneath): the block leaves every tier, the request goes back to waiting before it ever
    ran, and is admitted again with the first block alone cached: it computes the rest."""
    h = Harness(num_gpu_blocks=6, num_cpu_blocks=2, num_disk_blocks=8)
    _a_on_disk_only(h)
    a2 = make_request("a2", _prompt(10, 8) + [99])
    h.add(a2)

    def second_read_failed(out: SchedulerOutput) -> DiskTierReport:
        assert len(out.disk_read_records) == len(out.blocks_to_read_from_disk) == 2
        record = out.disk_read_records[1]
        assert record.token_ids == tuple(_prompt(14, 4))  # the record of the block expected
        return DiskTierReport(failed_reads=[(record.disk_block, record.uid)])

    h.step(disk_report=second_read_failed)
    assert a2.status == RequestStatus.WAITING and a2.seqs[0].num_computed_tokens == 0
    stats = h.scheduler.make_stats().kv_tiers
    assert stats.num_failed_disk_reads == 1 and h.bm.num_cached_blocks(DISK) == 3
    out = h.step()  # admitted again: block 0 hits (its copy is loading), block 1 is computed
    seq_id = a2.seqs[0].seq_id
    assert seq_id not in out.num_scheduled_tokens and out.blocks_to_load_from_cpu
    out = h.step()
    assert out.num_scheduled_tokens == {seq_id: 5}
    h.finish()


def test_a_failed_write_drops_its_disk_copy_and_stops_the_writes():
    h = Harness(num_gpu_blocks=6, num_cpu_blocks=2, num_disk_blocks=8)
    h.add(make_request("a", _prompt(10, 9)))
    h.step()
    out = h.step(disk_report=lambda out: None)  # a's blocks written through
    records = out.disk_write_records
    assert len(records) == 2 and h.bm.num_cached_blocks(DISK) == 2
    failed = [(r.disk_block, r.uid) for r in records]
    h.step(disk_report=lambda out: DiskTierReport([], failed, True))
    assert h.bm.num_cached_blocks(DISK) == 0
    h.add(make_request("b", _prompt(40, 9)))
    for _ in range(4):
        assert h.step().blocks_to_write_to_disk == []
    stats = h.scheduler.make_stats().kv_tiers
    assert stats.num_failed_disk_writes == 2 and stats.are_disk_writes_stopped
    h.finish()


def test_pipelined_steps_wait_for_the_report_of_a_disk_read():
    """With several steps in flight (pipeline parallelism), the step whose sequences read a
    disk block is not planned before the report of the step that read it."""
    h = Harness(num_gpu_blocks=6, num_cpu_blocks=2, num_disk_blocks=8)
    _a_on_disk_only(h)
    h.add(make_request("a2", _prompt(10, 8) + [99]))
    s = h.scheduler
    reading = s.schedule()
    assert reading.blocks_to_read_from_disk
    s.advance(reading, placeholders=False)
    loading = s.schedule(overlap=True)  # N + 1: loads the read blocks, a2 does not run
    assert loading is not None and loading.blocks_to_load_from_cpu
    s.advance(loading, placeholders=False)
    assert s.schedule(overlap=True) is None  # N + 2 would run a2: the report first
    s.update_from_output(reading, ModelRunnerOutput())
    assert s.schedule(overlap=True) is not None


def test_abort_during_a_load_frees_everything():
    h = Harness(num_gpu_blocks=6, num_cpu_blocks=8)
    _evict_into_cpu(h)
    h.add(make_request("a2", _prompt(10, 8) + [99], max_tokens=4))
    out = h.step()
    assert out.blocks_to_load_from_cpu
    assert h.scheduler.abort_request("a2")
    out = h.step()
    assert out.finished_request_ids == ["a2"] and out.num_seqs == 0
    h.finish()


def test_abort_and_reuse_in_the_step_of_the_load_drops_it():
    """A sequence given its blocks with loads, then let go in the same step (an admission
    rolled back) and its GPU blocks handed on: the load is dropped, never copied over the new
    owner's blocks."""
    h = Harness(num_gpu_blocks=6, num_cpu_blocks=8)
    _evict_into_cpu(h)
    seq = Sequence.new(0, _prompt(10, 8) + [99])
    assert h.scheduler.blocks.allocate(seq, "") == 8  # both blocks from the CPU tier
    h.scheduler.blocks.free(seq)
    h.add(make_request("e", _prompt(200, 24)))  # takes every GPU block
    out = h.step()
    assert out.blocks_to_load_from_cpu == []
    assert h.bm.tier_stats().num_dropped_loads == 2
    h.finish()


def test_preemption_during_a_load_then_resume():
    h = Harness(num_gpu_blocks=7, num_cpu_blocks=8)
    _evict_into_cpu(h)
    c = make_request("c", _prompt(70, 4), max_tokens=6)
    h.add(c)
    h.step()  # c: 4 prompt tokens, 1 block
    # f fills two blocks and needs a third at its first decode; a2 loads 2 blocks (+1).
    f = make_request("f", _prompt(300, 8), max_tokens=3)
    a2 = make_request("a2", _prompt(10, 8) + [99], max_tokens=2)
    h.add(f, a2)
    out = h.step()
    assert len(out.blocks_to_load_from_cpu) == 2 and h.bm.num_free_blocks(GPU) == 0
    # The next step: f's block preempts a2 (the latest arrival), its load done but unread.
    out = h.step()
    assert h.scheduler.stats.num_preemptions == 1 and a2.status == RequestStatus.WAITING
    assert a2.seqs[0].seq_id not in out.num_scheduled_tokens
    h.finish()  # a2 comes back later and completes; nothing is left behind
    assert a2.status == RequestStatus.FINISHED


def test_a_step_that_never_ran_leaves_no_block_unloaded():
    """The runner failed on the step that carried the loads: discard() forgets them, so the
    next request with that prefix loads it again instead of reading blocks never written."""
    h = Harness(num_gpu_blocks=6, num_cpu_blocks=8)
    _evict_into_cpu(h)
    h.add(make_request("a2", _prompt(10, 8) + [99]))
    out = h.scheduler.schedule()
    assert len(out.blocks_to_load_from_cpu) == 2
    h.scheduler.discard(out)
    assert h.scheduler.abort_request("a2")  # what a caller that keeps the engine does
    h.add(make_request("a3", _prompt(10, 8) + [98]))
    out = h.step()
    assert len(out.blocks_to_load_from_cpu) == 2  # from the CPU tier again
    assert h.bm.tier_stats().gpu_hit_tokens == 0
    h.finish()


def test_a_restart_reuses_the_disk_records_but_not_lora_ones(caplog):
    h = Harness(num_gpu_blocks=6, num_cpu_blocks=4, num_disk_blocks=8)
    plain = make_request("p", _prompt(10, 9))
    lora = make_request("l", _prompt(10, 9))
    lora.cache_salt = prefix_cache_salt("", LoRARequest("sql", 1, "/x"))
    h.add(plain, lora)
    records = []
    for _ in range(4):  # computed, then written through to disk
        records += h.step().disk_write_records
    assert len(records) == 4 and sum(is_lora_salt(r.salt) for r in records) == 2
    with caplog.at_level(logging.INFO):
        restarted = Scheduler(
            SchedulerConfig(
                block_size=BLOCK_SIZE,
                num_gpu_blocks=6,
                num_cpu_blocks=4,
                max_num_seqs=8,
                max_num_batched_tokens=64,
                max_model_len=64,
                tiers=KVTierConfig(enable_cpu_tier=True, num_disk_blocks=8, disk_records=records),
            )
        )
    assert restarted.block_manager.num_cached_blocks(DISK) == 2  # the adapter's are not
    assert "LoRA adapters are not reused" in caplog.text
    assert restarted.make_stats().kv_tiers.num_restored_disk_blocks == 2
