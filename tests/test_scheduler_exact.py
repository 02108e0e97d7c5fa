"""The scheduler step by step, exactly: a real C++ block manager, small factories, and the
plain SchedulerOutput of every step asserted (admission order, chunk sizes under the token
budget, who is preempted, swap pairs, prefix hits, copy-on-write deltas). The model runner's
side is its real InputBatch (numpy only), so the deltas are also checked to rebuild the right
inputs (token ids, positions, slot mapping)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from pydaemon.core.request import Request, RequestStatus, Sequence
from pydaemon.core.runner_output import ModelRunnerOutput
from pydaemon.core.sched.scheduler import Scheduler
from pydaemon.core.sched.scheduler_config import SchedulerConfig
from pydaemon.core.sched.scheduler_output import SchedulerOutput
from pydaemon.core.stop_checker import StopChecker
from pydaemon.outputs import RequestMetrics
from pydaemon.sampling_params import SamplingParams
from pydaemon.worker.input_batch import InputBatch

BLOCK_SIZE = 4
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
_arrival = itertools.count()


def make_request(
    request_id: str,
    prompt: list[int],
    params: SamplingParams = GREEDY,
    *,
    priority: int = 0,
) -> Request:
    request = Request(
        request_id=request_id,
        prompt_token_ids=prompt,
        params=params,
        eos_token_ids={2},
        priority=priority,
        metrics=RequestMetrics(arrival_time=float(next(_arrival))),
    )
    request.stop_checker = StopChecker(params, request.eos_token_ids)
    request.seqs.append(Sequence.new(0, prompt))
    return request


class Harness:
    """A scheduler on a real block manager, and the runner's InputBatch fed its outputs."""

    def __init__(
        self,
        num_gpu_blocks: int,
        *,
        num_cpu_blocks: int = 0,
        budget: int = 64,
        max_num_seqs: int = 8,
        preemption_mode: str = "recompute",
        prefix_caching: bool = True,
    ) -> None:
        self.scheduler = Scheduler(
            SchedulerConfig(
                block_size=BLOCK_SIZE,
                num_gpu_blocks=num_gpu_blocks,
                num_cpu_blocks=num_cpu_blocks,
                max_num_seqs=max_num_seqs,
                max_num_batched_tokens=budget,
                max_model_len=64,
                preemption_mode=preemption_mode,
                enable_prefix_caching=prefix_caching,
            )
        )
        self.bm = self.scheduler.block_manager
        self.batch = InputBatch(max_num_seqs, 64, BLOCK_SIZE)

    def add(self, *requests: Request) -> None:
        for request in requests:
            self.scheduler.add_request(request)

    def seq_id(self, request_id: str, index: int = 0) -> int:
        request = self.scheduler.requests[request_id]
        return next(s.seq_id for s in request.seqs if s.index == index)

    def step(self, tokens: dict[int, list[int]] | None = None) -> SchedulerOutput:
        """schedule(); the runner's state update and inputs; update_from_output() with
        ``tokens[seq_id]`` (default [7], or one per fork) for every sequence that samples."""
        out = self.scheduler.schedule()
        self.batch.update(out)
        self.inputs = self.batch.prepare(out) if out.num_seqs else None
        runner_output = ModelRunnerOutput()
        if self.inputs is not None:
            sampled = np.asarray(self.inputs.seq_ids)[self.inputs.is_sampled].tolist()
            for seq_id in sampled:
                ids = (tokens or {}).get(seq_id) or [7] * out.num_samples.get(seq_id, 1)
                runner_output.seq_ids.append(seq_id)
                runner_output.sampled_token_ids.append(ids)
                runner_output.chosen_logprobs.append([-1.0] * len(ids))
                runner_output.logprobs.append([None] * len(ids))
        self.outputs = self.scheduler.update_from_output(out, runner_output)
        return out


def _prompt(start: int, length: int) -> list[int]:
    return list(range(start, start + length))


def test_admission_order_is_priority_then_arrival():
    h = Harness(num_gpu_blocks=32)
    a, b = make_request("a", _prompt(10, 5)), make_request("b", _prompt(20, 3))
    c = make_request("c", _prompt(30, 6), priority=-1)  # most urgent, arrived last
    h.add(a, b, c)
    out = h.step()
    assert [n.request_id for n in out.scheduled_new_seqs] == ["c", "a", "b"]
    assert list(out.num_scheduled_tokens.values()) == [6, 5, 3]
    assert out.num_prefills == 3
    assert [n.block_ids for n in out.scheduled_new_seqs] == [[0, 1], [2, 3], [4]]
    # The runner rebuilt the inputs from the plain data alone.
    assert h.inputs.input_ids.tolist() == _prompt(30, 6) + _prompt(10, 5) + _prompt(20, 3)
    assert h.inputs.positions.tolist() == [*range(6), *range(5), *range(3)]
    assert h.inputs.slot_mapping.tolist() == [0, 1, 2, 3, 4, 5, 8, 9, 10, 11, 12, 16, 17, 18]
    assert h.inputs.is_sampled.tolist() == [True, True, True]


def test_chunked_prefill_under_the_token_budget():
    h = Harness(num_gpu_blocks=32, budget=10)
    a, b = make_request("a", _prompt(10, 7)), make_request("b", _prompt(40, 9))
    h.add(a, b)
    out = h.step()
    sa, sb = h.seq_id("a"), h.seq_id("b")
    assert out.num_scheduled_tokens == {sa: 7, sb: 3}  # b gets what is left: a chunk of 3
    assert h.inputs.is_sampled.tolist() == [True, False]  # a chunk samples nothing
    out = h.step()
    # Decodes first in the budget, then prefill chunks; the batch lists prefills first.
    assert out.num_scheduled_tokens == {sb: 6, sa: 1}
    assert out.num_prefills == 1
    assert out.scheduled_new_seqs == []
    cached = out.scheduled_cached_seqs
    assert cached.seq_ids == [sb, sa]
    assert cached.new_token_ids == [[], [7]]  # a's sampled token, sent once
    assert cached.num_computed_tokens == [3, 7]
    assert cached.new_block_ids == [None, None]  # b got all 3 blocks at admission
    assert h.inputs.input_ids.tolist() == _prompt(43, 6) + [7]
    assert h.inputs.positions.tolist() == [3, 4, 5, 6, 7, 8, 7]
    assert h.inputs.slot_mapping.tolist() == [11, 12, 13, 14, 15, 16, 7]
    out = h.step()
    assert out.num_scheduled_tokens == {sa: 1, sb: 1}
    assert out.scheduled_cached_seqs.new_token_ids == [[7], [7]]
    # a's 9th token opens its third block (the next free one); b's 10th fits its third.
    assert out.scheduled_cached_seqs.new_block_ids == [(2, [5]), None]
    assert h.inputs.slot_mapping.tolist() == [20, 17]


def test_recompute_preemption_takes_the_latest_arrival():
    h = Harness(num_gpu_blocks=4)
    a, b = make_request("a", _prompt(10, 8)), make_request("b", _prompt(40, 8))
    h.add(a, b)
    h.step()  # both prompts fill the pool: 2 + 2 blocks
    sa, sb = h.seq_id("a"), h.seq_id("b")
    assert h.bm.num_free_blocks() == 0
    out = h.step()  # a's 9th token needs a block: b (arrived later) is preempted
    assert out.num_scheduled_tokens == {sa: 1}
    assert out.finished_seq_ids == [sb]  # the runner forgets b
    assert out.scheduled_cached_seqs.new_block_ids == [(2, [3])]  # one of b's freed blocks
    assert [r.request_id for r in h.scheduler.waiting] == ["b"]
    assert b.status == RequestStatus.WAITING and b.seqs[0].num_computed_tokens == 0
    assert h.scheduler.stats.num_preemptions == 1


def test_swap_preemption_pairs_and_resume():
    h = Harness(num_gpu_blocks=5, num_cpu_blocks=4, preemption_mode="swap")
    a = make_request("a", _prompt(10, 8), SamplingParams(temperature=0.0, max_tokens=1))
    b = make_request("b", _prompt(40, 8))
    h.add(a, b)
    h.step()
    sb = h.seq_id("b")
    assert [o.finished for o in h.outputs.outputs] == [True, False]  # a freed its 2 blocks
    c = make_request("c", _prompt(70, 8))
    h.add(c)
    out = h.step()  # b's 9th token takes a block; c is admitted into the last two
    sc = h.seq_id("c")
    assert out.num_scheduled_tokens == {sc: 8, sb: 1}
    c_blocks = out.scheduled_new_seqs[0].block_ids
    assert h.bm.num_free_blocks() == 0
    out = h.step()  # c's 9th token needs a block, none is free: c (latest) is swapped out
    assert out.blocks_to_swap_out == [(c_blocks[0], 0), (c_blocks[1], 1)]
    assert out.finished_seq_ids == [sc]
    assert out.num_scheduled_tokens == {sb: 1}
    assert [r.request_id for r in h.scheduler.swapped] == ["c"]
    assert h.scheduler.stats.num_swapped_out_blocks == 2
    for _ in range(8):  # b decodes to its max_tokens
        out = h.step()
        if out.blocks_to_swap_in:
            break
    assert "b" not in h.scheduler.requests  # b finished: c comes back
    # Its CPU blocks are swapped into free GPU blocks, one more block takes its pending
    # token, and the runner gets it whole again, with the new block table.
    (new,) = out.scheduled_new_seqs
    assert new.seq_id == sc
    assert [cpu for cpu, _ in out.blocks_to_swap_in] == [0, 1]
    assert new.block_ids[:2] == [gpu for _, gpu in out.blocks_to_swap_in]
    assert len(new.block_ids) == 3
    assert new.num_computed_tokens == 8 and new.token_ids == _prompt(70, 8) + [7]
    assert out.num_scheduled_tokens == {sc: 1}


def test_prefix_hit_skips_cached_blocks():
    h = Harness(num_gpu_blocks=16)
    shared = _prompt(10, 8)
    h.add(make_request("a", shared + [99, 98, 97]))
    out = h.step()
    a_blocks = out.scheduled_new_seqs[0].block_ids
    h.add(make_request("b", shared + [50]))
    out = h.step()
    sb = h.seq_id("b")
    (new,) = out.scheduled_new_seqs
    assert new.num_computed_tokens == 8  # two full cached blocks
    assert new.block_ids[:2] == a_blocks[:2]
    assert out.num_scheduled_tokens[sb] == 1
    assert h.scheduler.requests["b"].metrics.num_cached_tokens == 8
    assert h.inputs.positions.tolist() == [8, 11]  # b computes only its last token; a decodes


def test_fork_at_first_sample_and_copy_on_write_delta():
    params = SamplingParams(n=2, temperature=1.0, seed=1, max_tokens=4, ignore_eos=True)
    h = Harness(num_gpu_blocks=16)
    h.add(make_request("p", _prompt(10, 6), params))
    out = h.step({})
    s0 = h.seq_id("p")
    assert out.num_samples == {s0: 2}  # one logits row, sampled for indices 0 and 1
    out = h.step()
    s1 = h.seq_id("p", 1)
    assert {s.index for s in h.scheduler.requests["p"].seqs} == {0, 1}
    # The child is new to the runner; the parent's shared partial block was copied on write.
    (child,) = out.scheduled_new_seqs
    assert child.seq_id == s1 and child.token_ids == _prompt(10, 6) + [7]
    assert out.blocks_to_copy == [(1, 2)]
    assert out.scheduled_cached_seqs.seq_ids == [s0]
    assert out.scheduled_cached_seqs.new_block_ids == [(1, [2])]
    assert child.block_ids == [0, 1]
    assert out.num_samples == {}


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_abort_frees_blocks_and_tells_the_runner(mode):
    h = Harness(num_gpu_blocks=8, num_cpu_blocks=8, preemption_mode=mode)
    h.add(make_request("a", _prompt(10, 6)), make_request("b", _prompt(30, 6)))
    h.step()
    sa = h.seq_id("a")
    assert h.scheduler.abort_request("a")
    assert not h.scheduler.abort_request("a")
    assert h.bm.num_free_blocks() == 8 - 2
    out = h.step()
    assert out.finished_seq_ids == [sa] and out.finished_request_ids == ["a"]
    assert sa not in h.batch.seqs


def test_overlapped_schedule_decodes_placeholders_and_refuses_preemption():
    """Async scheduling: the next step is planned on placeholder tokens while the last one
    runs; a step that would have to preempt is refused, changing nothing."""
    from pydaemon.core.request import PLACEHOLDER_TOKEN_ID

    h = Harness(num_gpu_blocks=5)
    a, b = make_request("a", _prompt(10, 7)), make_request("b", _prompt(40, 8))
    h.add(a, b)
    first = h.scheduler.schedule()
    h.batch.update(first)
    h.scheduler.advance(first)  # launched: a and b hold a placeholder each
    sa, sb = h.seq_id("a"), h.seq_id("b")
    assert a.seqs[0].output_token_ids == [PLACEHOLDER_TOKEN_ID]
    free = h.bm.free_block_ids()
    second = h.scheduler.schedule(overlap=True)  # a's 8th token fits; b's 9th takes block 4
    assert second.num_scheduled_tokens == {sa: 1, sb: 1}
    assert second.scheduled_cached_seqs.new_token_ids == [[PLACEHOLDER_TOKEN_ID]] * 2
    assert second.scheduled_cached_seqs.new_block_ids == [None, (2, [4])]
    assert h.bm.free_block_ids() == free[1:]
    ro = ModelRunnerOutput(seq_ids=[sa, sb], sampled_token_ids=[[5], [6]],
                           chosen_logprobs=[[-1.0], [-1.0]], logprobs=[[None], [None]])  # fmt: skip
    outputs = h.scheduler.update_from_output(first, ro)  # the first step's results arrive
    assert [s.new_token_ids for o in outputs.outputs for s in o.seqs] == [[5], [6]]
    assert a.seqs[0].output_token_ids == [5] and b.seqs[0].output_token_ids == [6]
    h.scheduler.advance(second)
    assert a.seqs[0].num_computed_tokens == 8 and b.seqs[0].num_computed_tokens == 9
    # a's 9th token needs a block and none is free: only a synchronous step may preempt.
    assert h.scheduler.schedule(overlap=True) is None
    assert h.bm.free_block_ids() == [] and h.scheduler.running == [a, b]
    with pytest.raises(RuntimeError, match="oldest pending"):
        h.scheduler.update_from_output(first, ro)
