"""The scheduler's LoRA budget, exactly: at most ``max_loras`` distinct adapters among running
requests; a waiting request whose adapter has no slot lets later requests (of running adapters,
or of none) go first, and runs once a slot frees; per-adapter counts for the stats."""

from __future__ import annotations

import itertools

from pydaemon.core.request import Request, Sequence
from pydaemon.core.sched.lora_budget import LoRABudget
from pydaemon.core.sched.scheduler import Scheduler
from pydaemon.core.sched.scheduler_config import SchedulerConfig
from pydaemon.core.stop_checker import StopChecker
from pydaemon.lora_request import LoRARequest
from pydaemon.outputs import RequestMetrics
from pydaemon.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
A, B = LoRARequest("a", 1, "/a"), LoRARequest("b", 2, "/b")
_arrival = itertools.count()


def _request(request_id: str, lora: LoRARequest | None) -> Request:
    request = Request(
        request_id=request_id,
        prompt_token_ids=[5, 6, 7],
        params=GREEDY,
        eos_token_ids={2},
        lora_request=lora,
        metrics=RequestMetrics(arrival_time=float(next(_arrival))),
    )
    request.stop_checker = StopChecker(GREEDY, request.eos_token_ids)
    request.seqs.append(Sequence.new(0, request.prompt_token_ids))
    return request


def _scheduler(max_loras: int | None) -> Scheduler:
    return Scheduler(
        SchedulerConfig(
            block_size=4,
            num_gpu_blocks=64,
            max_num_seqs=8,
            max_num_batched_tokens=64,
            max_model_len=64,
            max_loras=max_loras,
        )
    )


def test_a_request_whose_adapter_has_no_slot_waits_and_lets_others_pass():
    sched = _scheduler(max_loras=1)
    for request_id, lora in (("a1", A), ("b1", B), ("base", None), ("a2", A)):
        sched.add_request(_request(request_id, lora))
    out = sched.schedule()
    admitted = [new.request_id for new in out.scheduled_new_seqs]
    assert admitted == ["a1", "base", "a2"]  # b1 waits: adapter a holds the one slot
    assert [new.lora_request for new in out.scheduled_new_seqs] == [A, None, A]
    assert [r.request_id for r in sched.waiting] == ["b1"]
    assert LoRABudget.count_by_adapter(sched.running, sched.waiting) == {"a": (2, 0), "b": (0, 1)}
    for request_id in ("a1", "a2"):
        sched.abort_request(request_id)
    out = sched.schedule()
    assert [new.request_id for new in out.scheduled_new_seqs] == ["b1"]  # a's slot is free


def test_without_lora_the_queue_is_first_come_first_served():
    sched = _scheduler(max_loras=None)
    for request_id in ("x", "y"):
        sched.add_request(_request(request_id, None))
    assert [n.request_id for n in sched.schedule().scheduled_new_seqs] == ["x", "y"]
    assert LoRABudget(None).first_fitting([], sched.running) is None
