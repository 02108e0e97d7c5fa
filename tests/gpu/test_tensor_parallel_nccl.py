"""Tensor parallelism on two GPUs over NCCL: greedy output of TP=2 equals TP=1 token for token;
with async scheduling, TP=2 equals TP=2 synchronous (bf16, CUDA graphs) and TP=1 (float32).

Float32 on purpose: the row-parallel all-reduce sums in another order than one GPU does, which
in bf16 can flip a near-tie; in float32 the difference stays far below any logit gap of these
prompts. bf16 speed under TP is what bench/throughput.py --tensor-parallel-size measures.
"""

from __future__ import annotations

import sys
import time
import warnings
from pathlib import Path

import pytest
import torch

from pydaemon._core import Device
from pydaemon.entrypoints.llm import LLM
from pydaemon.generate_request import GenerateRequest
from pydaemon.sampling_params import SamplingParams

sys.path.insert(0, str(Path(__file__).parents[1]))
from engine_utils import make_hf_model, random_prompts  # noqa: E402

pytestmark = pytest.mark.skipif(
    torch.cuda.device_count() < 2, reason="needs two CUDA GPUs (NCCL tensor parallelism)"
)

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8, 9], [10, 20, 30], list(range(40, 110)), [3] * 33]
COMMON = dict(device="cuda", dtype="float32", max_num_seqs=4, block_size=16)


def _tokens(llm: LLM) -> list[list[int]]:
    outputs = llm.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY)
    return [o.outputs[0].token_ids for o in outputs]


def test_nccl_tp2_greedy_equals_tp1(tmp_path):
    # GQA 8/4 with a vocabulary that does not split evenly: both ranks hold KV heads and the
    # last rank's vocabulary slice is padded.
    model_dir, _ = make_hf_model(
        tmp_path / "llama", num_heads=8, num_kv_heads=4, vocab_size=1001, hidden_size=128
    )
    ref = _tokens(LLM(str(model_dir), **COMMON))
    llm = LLM(str(model_dir), tensor_parallel_size=2, **COMMON)
    try:
        got = _tokens(llm)
    finally:
        llm.engine.shutdown()
    assert got == ref


# ---- async scheduling under tensor parallelism ------------------------------------------------
# Rank 0 broadcasts each step's sampled ids over NCCL; every rank fills the next step's
# placeholder tokens from them on the device (ModelRunner._share_sampled_ids).

ASYNC_VOCAB = 1001


@pytest.fixture(scope="module")
def async_model(tmp_path_factory):
    # Head dim 64 and bf16: the CUDA kernels, so decode steps replay CUDA graphs.
    path, _ = make_hf_model(
        tmp_path_factory.mktemp("nccl_async") / "llama",
        hidden_size=512,
        num_heads=8,
        num_kv_heads=2,
        vocab_size=ASYNC_VOCAB,
        seed=3,
    )
    return path


def _completions(outputs) -> list[list[tuple]]:
    return [[(c.token_ids, c.finish_reason) for c in o.outputs] for o in outputs]


def _generate(path, prompts, params, **kwargs) -> tuple[list, dict]:
    """Outputs, and what ran: overlapped steps, graph replays on rank 0, blocks left."""
    llm = LLM(str(path), device="cuda", num_kv_blocks=512, **kwargs)
    try:
        outputs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
        core = llm.engine.core
        stepper, graphs = core.async_stepper, core.executor.driver_runner.cuda_graphs
        bm = core.scheduler.block_manager
        info = {
            "overlapped": 0 if stepper is None else stepper.num_overlapped_steps,
            "replays": 0 if graphs is None else graphs.num_replays,
            "blocks_in_use": bm.num_used_blocks(Device.GPU),
        }
    finally:
        llm.engine.shutdown()
    return _completions(outputs), info


def test_nccl_tp2_async_equals_tp2_sync_bf16_with_graphs(async_model):
    """Every request runs the same number of steps: async and sync run identical batches
    (identical kernels and all-reduces), so bf16 tokens must be equal exactly."""
    prompts = random_prompts(16, ASYNC_VOCAB, 5, 120, seed=1)
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
    common = dict(dtype="bfloat16", tensor_parallel_size=2, max_num_seqs=16)
    sync, sync_info = _generate(async_model, prompts, params, async_scheduling=False, **common)
    asyn, info = _generate(async_model, prompts, params, async_scheduling=True, **common)
    assert info["overlapped"] > 30, f"decode steps were not overlapped: {info}"
    assert info["replays"] > 30 and sync_info["replays"] > 30, "decode graphs did not run"
    assert info["blocks_in_use"] == 0
    for i, (a, s) in enumerate(zip(asyn, sync, strict=True)):
        assert a == s, f"request {i} ({params[i]}) differs between TP=2 async and TP=2 sync"


def test_nccl_tp2_async_mixed_lengths_n2_float32_equals_tp1(async_model):
    """Requests end at different steps (EOS-like stop ids, lengths), one forks (n=2: sync
    fallback steps on both ranks): float32 keeps TP=2 async equal to TP=1 synchronous."""
    prompts = random_prompts(10, ASYNC_VOCAB, 5, 60, seed=2)
    common = dict(dtype="float32", max_num_seqs=8, max_num_batched_tokens=96)
    probe, _ = _generate(
        async_model,
        prompts[:1],
        SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
        **common,
    )
    stop_id = probe[0][0][0][4]
    params = [
        SamplingParams(temperature=0.0, max_tokens=8 + 3 * i, stop_token_ids=[stop_id])
        for i in range(9)
    ] + [SamplingParams(n=2, temperature=0.8, seed=5, max_tokens=12, ignore_eos=True)]
    ref, _ = _generate(async_model, prompts[:9], params[:9], async_scheduling=False, **common)
    ref_fork, _ = _generate(async_model, prompts[9:], params[9:], async_scheduling=False, **common)
    got, info = _generate(
        async_model, prompts[:9], params[:9], tensor_parallel_size=2, async_scheduling=True,
        **common,
    )  # fmt: skip
    assert info["overlapped"] > 10 and info["blocks_in_use"] == 0, info
    assert got == ref
    assert got[0][0][1] == "stop" and got[0][0][0][-1] == stop_id
    got_fork, info = _generate(
        async_model, prompts[9:], params[9:], tensor_parallel_size=2, async_scheduling=True,
        **common,
    )  # fmt: skip
    assert info["overlapped"] == 0 and info["blocks_in_use"] == 0, info
    assert got_fork == ref_fork


def test_nccl_tp2_async_launch_never_waits_for_the_gpu(async_model):
    """Rank 0's stream is kept busy; an async step (its inputs, the broadcast of the last
    step's sampled ids, the forward with its all-reduces, sampling, the copy back) must return
    while it still runs. A host sync anywhere in rank 0's launch path fails this."""
    llm = LLM(
        str(async_model), device="cuda", dtype="bfloat16", num_kv_blocks=512,
        tensor_parallel_size=2, async_scheduling=True,
    )  # fmt: skip
    try:
        prompts = random_prompts(8, ASYNC_VOCAB, 20, 40, seed=4)
        params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
        for i, prompt in enumerate(prompts):
            llm.engine.add_request(GenerateRequest(str(i), prompt, params))
        for _ in range(4):  # prefill, then decodes with a step in flight
            llm.engine.step()
        stepper = llm.engine.core.async_stepper
        assert stepper.in_flight is not None
        overlapped = stepper.num_overlapped_steps
        torch.cuda.synchronize()
        torch.cuda._sleep(1_000_000_000)  # ~0.5 s of GPU time on rank 0's compute stream
        start = time.perf_counter()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                llm.engine.step()
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
        bm = llm.engine.core.scheduler.block_manager
        assert bm.num_used_blocks(Device.GPU) == 0
    finally:
        llm.engine.shutdown()
