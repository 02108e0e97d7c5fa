"""The ``ray`` executor on one GPU: Ray gives the rank's bundle the GPU (a local Ray instance,
started and stopped by the engine) and the rank runs in the engine's process on that GPU; the
greedy tokens equal the engine's without Ray, with async scheduling and CUDA graphs on (the
defaults), token for token."""

from __future__ import annotations

import pytest

from pydaemon.entrypoints.llm import LLM
from pydaemon.sampling_params import SamplingParams

ray = pytest.importorskip("ray")


def test_ray_rank_on_the_gpu_equals_in_process():
    prompts = [[5, 6, 7, 8, 9], [10, 20, 30], list(range(40, 75)), [3] * 17]
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    kw = dict(device="cuda", dtype="bfloat16", num_kv_blocks=256, max_num_seqs=8)

    def tokens(llm: LLM) -> list[list[int]]:
        outputs = llm.generate(prompt_token_ids=prompts, sampling_params=greedy)
        return [o.outputs[0].token_ids for o in outputs]

    expected = tokens(LLM("demo", **kw))
    llm = LLM("demo", distributed_executor_backend="ray", **kw)
    try:
        assert llm.engine.core.async_stepper is not None  # async scheduling, as in process
        assert llm.engine.core.executor.driver_runner is not None, "the rank left this process"
        assert tokens(llm) == expected
    finally:
        llm.engine.shutdown()
    assert not ray.is_initialized(), "the engine's local Ray instance outlived it"
