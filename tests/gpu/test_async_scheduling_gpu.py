"""Async scheduling on a GPU: the same tokens as synchronous steps, and a step's launch
(schedule, inputs, forward, sampling, the copy back) never waits for the GPU."""

from __future__ import annotations

import sys
import time
import warnings
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from engine_utils import make_hf_model, random_prompts  # noqa: E402

from pydaemon import LLM, SamplingParams  # noqa: E402
from pydaemon._core import Device  # noqa: E402
from pydaemon.generate_request import GenerateRequest

VOCAB = 512


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path, _ = make_hf_model(
        tmp_path_factory.mktemp("gpu_async"),
        hidden_size=512,
        num_heads=8,
        num_kv_heads=2,
        num_layers=2,
        vocab_size=VOCAB,
        seed=3,
    )
    return path


def _llm(path, is_async: bool, dtype: str, **kwargs) -> LLM:
    return LLM(
        str(path),
        device="cuda",
        dtype=dtype,
        num_kv_blocks=512,
        async_scheduling=is_async,
        **kwargs,
    )


def _is_free(llm: LLM) -> bool:
    bm = llm.engine.block_manager
    return bm.num_free_blocks(Device.GPU) == bm.num_total_blocks(Device.GPU)


def _run_both(path, prompts, params, dtype: str):
    results = []
    for is_async in (False, True):
        llm = _llm(path, is_async, dtype)
        outputs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
        results.append([[(c.token_ids, c.finish_reason) for c in o.outputs] for o in outputs])
        assert _is_free(llm), f"blocks left in use (async={is_async})"
    assert llm.engine.core.async_stepper.num_overlapped_steps > 0, "no step was overlapped"
    return results


def test_default_is_on_for_cuda(model):
    llm = LLM(str(model), device="cuda", dtype="float16", num_kv_blocks=64)
    assert llm.engine.core.async_stepper is not None


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_greedy_and_seeded_same_batches_match_sync(model, dtype):
    """Every request runs the same number of steps, so both modes run identical batches
    (identical kernels): the tokens must be equal exactly."""
    prompts = random_prompts(16, VOCAB, 5, 120, seed=1)
    params = [
        SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True),
        SamplingParams(temperature=0.8, top_p=0.9, seed=11, max_tokens=40, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=40, repetition_penalty=1.3, ignore_eos=True),
        SamplingParams(
            temperature=0.7,
            seed=12,
            max_tokens=40,
            presence_penalty=1.0,
            logprobs=2,
            ignore_eos=True,
        ),  # fmt: skip
    ] * 4
    sync, asyn = _run_both(model, prompts, params, dtype)
    for i, (a, s) in enumerate(zip(asyn, sync, strict=True)):
        assert a == s, f"request {i} ({params[i]}) differs between async and sync"


def test_mixed_lengths_eos_and_stop_ids_match_sync_float32(model):
    """Requests end at different steps (an ended sequence still runs in the step launched
    before its end was known, so batches differ by those rows): float32 keeps tokens equal."""
    prompts = random_prompts(12, VOCAB, 5, 60, seed=2)
    probe = _llm(model, False, "float32").generate(
        prompt_token_ids=prompts[:1],
        sampling_params=SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
    )
    stop_id = probe[0].outputs[0].token_ids[4]
    params = [
        SamplingParams(temperature=0.0, max_tokens=8 + 3 * i, stop_token_ids=[stop_id], min_tokens=i % 3)
        for i in range(12)
    ]  # fmt: skip
    sync, asyn = _run_both(model, prompts, params, "float32")
    assert asyn == sync
    assert asyn[0][0][1] == "stop" and asyn[0][0][0][-1] == stop_id


def test_launching_a_step_never_waits_for_the_gpu(model):
    """A long kernel keeps the stream busy; an async step (schedule, inputs, forward, sampling
    with seeds, penalties, min_tokens and logprobs, the copy back) must return while it still
    runs. A blocking host-device copy or sync anywhere in the launch path fails this."""
    llm = _llm(model, True, "float16")
    core = llm.engine.core
    prompts = random_prompts(8, VOCAB, 20, 40, seed=4)
    kinds = [
        SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True),
        SamplingParams(temperature=0.9, seed=5, top_k=20, max_tokens=64, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=64, frequency_penalty=0.5, min_tokens=60),
        SamplingParams(temperature=0.5, seed=6, max_tokens=64, logprobs=3, ignore_eos=True),
    ]
    for i, prompt in enumerate(prompts):
        llm.engine.add_request(GenerateRequest(str(i), prompt, kinds[i % len(kinds)]))
    for _ in range(4):  # prefill, then decodes with a step in flight
        llm.engine.step()
    stepper = core.async_stepper
    assert stepper.in_flight is not None
    overlapped = stepper.num_overlapped_steps
    torch.cuda.synchronize()
    torch.cuda._sleep(1_000_000_000)  # ~0.5 s of GPU time on the compute stream
    start = time.perf_counter()
    # torch reports its own synchronizing operations (.item(), copies to pageable memory...)
    # as warnings: on a failure they say where the launch path waited.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            llm.engine.step()  # launches the next step behind the sleep, reads the last one's
        finally:
            torch.cuda.set_sync_debug_mode("default")
    elapsed = time.perf_counter() - start
    still_busy = not torch.cuda.current_stream().query()
    syncs = [f"{w.filename}:{w.lineno}: {w.message}" for w in caught]
    assert stepper.num_overlapped_steps == overlapped + 1, "the step was not overlapped"
    assert still_busy, (
        f"the step waited for the GPU ({elapsed * 1e3:.1f} ms on the host); torch's "
        f"synchronizing calls: {syncs or 'none (a pinned allocation or an event wait?)'}"
    )
    torch.cuda.synchronize()
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
    assert _is_free(llm)
