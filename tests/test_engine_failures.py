"""A failure inside one request's processing fails that request alone; a request that outgrows
the KV cache ends with the reason, without resending what it already streamed."""

from __future__ import annotations

import pytest
from engine_utils import make_hf_model, random_prompts

from pydaemon import LLM, SamplingParams
from pydaemon._core import Device
from pydaemon.generate_request import GenerateRequest

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path, _ = make_hf_model(tmp_path_factory.mktemp("fail"), num_heads=4, num_kv_heads=2, seed=11)
    return str(path)


def _run(engine) -> dict[str, list]:
    """Steps until idle; every delivered RequestOutput, by request id."""
    seen: dict[str, list] = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            seen.setdefault(output.request_id, []).append(output)
    return seen


def _all_free(llm: LLM) -> bool:
    bm = llm.engine.block_manager
    return bm.num_free_blocks(Device.GPU) == bm.num_total_blocks(Device.GPU)


def _tokens(outputs, index: int = 0) -> list[int]:
    return [t for o in outputs for c in o.outputs if c.index == index for t in c.token_ids]


class _ExplodingStopChecker:
    def check_token(self, token_id: int, num_output_tokens: int):
        raise RuntimeError("boom in the stop check")


def test_stop_check_failure_fails_only_that_request(model_dir):
    prompts = random_prompts(2, 256, 9, 17, seed=1)
    llm = LLM(model_dir, device="cpu", dtype="float32", block_size=8, num_kv_blocks=64)
    alone = llm.generate(prompt_token_ids=prompts[:1], sampling_params=GREEDY)[0]
    engine = llm.engine
    engine.add_request(GenerateRequest("good", prompts[0], GREEDY))
    engine.add_request(GenerateRequest("bad", prompts[1], GREEDY))
    engine.scheduler.requests["bad"].stop_checker = _ExplodingStopChecker()
    seen = _run(engine)
    (bad,) = seen["bad"]
    assert bad.finished and "boom in the stop check" in bad.error
    assert "internal error" in bad.error and "'bad'" in bad.error
    assert [c.finish_reason for c in bad.outputs] == []  # nothing was ever streamed for it
    assert seen["good"][-1].finished and seen["good"][-1].error is None
    assert _tokens(seen["good"]) == alone.outputs[0].token_ids
    assert _all_free(llm)


def test_beam_step_failure_fails_only_that_request(model_dir):
    prompt = random_prompts(1, 256, 11, 11, seed=2)[0]
    params = SamplingParams(beam_width=3, n=2, temperature=0.0, max_tokens=6, ignore_eos=True)
    llm = LLM(model_dir, device="cpu", dtype="float32", block_size=8, num_kv_blocks=96)
    alone = llm.generate(prompt_token_ids=[prompt], sampling_params=params)[0]
    engine = llm.engine
    engine.add_request(GenerateRequest("good", prompt, params))
    engine.add_request(GenerateRequest("bad", prompt, params))

    def exploding_step(rows):
        raise ValueError("boom in the beam step")

    engine.scheduler.requests["bad"].beam.step = exploding_step
    seen = _run(engine)
    (bad,) = seen["bad"]
    assert bad.finished and "boom in the beam step" in bad.error
    (good,) = seen["good"]
    assert good.error is None
    assert [c.token_ids for c in good.outputs] == [c.token_ids for c in alone.outputs]
    assert _all_free(llm)


def test_request_outgrowing_the_cache_ends_with_the_reason_and_no_resend(model_dir):
    block_size, num_blocks, prompt_len = 8, 4, 20
    prompt = random_prompts(1, 256, prompt_len, prompt_len, seed=3)[0]
    llm = LLM(
        model_dir,
        device="cpu",
        dtype="float32",
        block_size=block_size,
        num_kv_blocks=num_blocks,
        watermark=0.0,
        max_num_batched_tokens=64,
        max_num_seqs=4,
    )
    engine = llm.engine
    engine.add_request(
        GenerateRequest(
            "big", prompt, SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)
        )
    )
    seen = _run(engine)["big"]
    final = seen[-1]
    assert final.finished and "needs more KV blocks" in final.error
    assert [o.finished for o in seen].count(True) == 1
    # Every token the sequence had room for was streamed once: the cache holds
    # num_blocks * block_size tokens, and the last sampled token needs no slot yet.
    streamed = _tokens(seen)
    assert len(streamed) == num_blocks * block_size + 1 - prompt_len
    assert [(c.token_ids, c.text, c.finish_reason) for c in final.outputs] == [([], "", "abort")]
    assert _all_free(llm)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_failed_forward_leaves_no_step_pending(model_dir, monkeypatch, async_scheduling):
    """A runner failure ends the step with the error; once its requests are aborted, the
    engine keeps serving (the failed step is not left pending in the scheduler)."""
    prompts = random_prompts(2, 256, 9, 17, seed=3)
    llm = LLM(model_dir, device="cpu", dtype="float32", block_size=8, num_kv_blocks=64,
              async_scheduling=async_scheduling)  # fmt: skip
    alone = llm.generate(prompt_token_ids=prompts[1:], sampling_params=GREEDY)[0]
    engine = llm.engine
    executor = engine.core.executor
    execute = executor.execute_model

    def fail_once(out):
        monkeypatch.setattr(executor, "execute_model", execute)
        raise RuntimeError("boom in the forward")

    monkeypatch.setattr(executor, "execute_model", fail_once)
    engine.add_request(GenerateRequest("lost", prompts[0], GREEDY))
    with pytest.raises(RuntimeError, match="boom in the forward"):
        engine.step()
    engine.abort_request("lost")
    assert _all_free(llm)
    engine.add_request(GenerateRequest("after", prompts[1], GREEDY))
    seen = _run(engine)
    assert _tokens(seen["after"]) == alone.outputs[0].token_ids
    assert _all_free(llm)


def test_a_failed_warmup_leaves_nothing_behind(model_dir, monkeypatch):
    """A warm-up whose step fails raises, frees its request and blocks, and can run again."""
    llm = LLM(model_dir, device="cpu", dtype="float32", block_size=8, num_kv_blocks=64)
    core = llm.engine.core
    real = core.executor.execute_model

    def exploding(*args, **kwargs):
        raise RuntimeError("boom in the warm-up step")

    monkeypatch.setattr(core.executor, "execute_model", exploding)
    with pytest.raises(RuntimeError, match="boom in the warm-up step"):
        llm.engine.warmup()
    assert not core.scheduler.requests and not llm.engine.has_unfinished_requests()
    assert _all_free(llm)
    monkeypatch.setattr(core.executor, "execute_model", real)
    llm.engine.warmup()  # no "request id '__warmup__' is already running"
    assert not core.scheduler.requests and _all_free(llm)
