"""queue_ms ends when a request is scheduled, not after its first step's compute (issue 32,
finding 9): the step plan is stamped when made, and first_scheduled_time comes from it."""

from __future__ import annotations

import time

from pydaemon.config.engine import EngineConfig
from pydaemon.engine.llm_engine import LLMEngine
from pydaemon.generate_request import GenerateRequest
from pydaemon.sampling_params import SamplingParams

STEP_S = 0.4


def test_first_scheduled_time_excludes_the_first_step():
    engine = LLMEngine(EngineConfig(model="demo", device="cpu", num_kv_blocks=64))
    executor = engine.core.executor
    execute = executor.execute_model

    def slow_execute(out):
        time.sleep(STEP_S)
        return execute(out)

    executor.execute_model = slow_execute
    engine.add_request(
        GenerateRequest("r", [3, 4, 5], SamplingParams(max_tokens=1, ignore_eos=True))
    )
    finished = []
    while engine.has_unfinished_requests():
        finished += [o for o in engine.step() if o.finished]
    m = finished[0].metrics
    assert m.first_scheduled_time - m.arrival_time < STEP_S / 2
    assert m.first_token_time - m.first_scheduled_time >= STEP_S
