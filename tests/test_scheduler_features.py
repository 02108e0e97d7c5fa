"""Issue 4's features through LLM.generate, proved by comparing outputs: chunked prefill,
preemption by recompute and by swap, prefix caching, parallel sampling on shared blocks."""

from __future__ import annotations

import pytest
import torch
from engine_utils import make_hf_model, random_prompts

from pydaemon import LLM, SamplingParams
from pydaemon._core import Device
from pydaemon.generate_request import GenerateRequest

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path, _ = make_hf_model(tmp_path_factory.mktemp("feat"), num_heads=4, num_kv_heads=2, seed=5)
    return str(path)


def _tokens(outputs):
    return [[c.token_ids for c in o.outputs] for o in outputs]


def _all_free(llm: LLM) -> bool:
    bm = llm.engine.block_manager
    return bm.num_free_blocks(Device.GPU) == bm.num_total_blocks(Device.GPU) and bm.num_free_blocks(
        Device.CPU
    ) == bm.num_total_blocks(Device.CPU)


@pytest.fixture(scope="module")
def reference(model_dir):
    """Outputs with plenty of blocks and budget, no prefix caching."""
    llm = LLM(
        model_dir,
        device="cpu",
        dtype="float32",
        num_kv_blocks=512,
        max_num_batched_tokens=4096,
        enable_prefix_caching=False,
    )
    prompts = random_prompts(8, 256, 20, 70, seed=11)
    return prompts, llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY)


@pytest.mark.parametrize("budget", [16, 37, 100])
def test_chunked_prefill_equals_unchunked(model_dir, reference, budget):
    prompts, ref = reference
    llm = LLM(
        model_dir,
        device="cpu",
        dtype="float32",
        num_kv_blocks=512,
        max_num_seqs=8,
        max_num_batched_tokens=budget,
    )
    assert _tokens(llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY)) == _tokens(ref)
    assert _all_free(llm)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_keeps_outputs(model_dir, reference, mode):
    prompts, ref = reference
    # 8 prompts of 20..70 tokens + 24 new each need far more than 24 blocks of 8 tokens.
    llm = LLM(
        model_dir,
        device="cpu",
        dtype="float32",
        block_size=8,
        num_kv_blocks=24,
        preemption_mode=mode,
        watermark=0.0,
    )
    outputs = llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY)
    assert _tokens(outputs) == _tokens(ref)
    stats = llm.engine.get_stats()
    assert stats.num_preemptions > 0
    if mode == "swap":
        assert stats.num_swapped_out_blocks > 0
        assert stats.num_swapped_in_blocks == stats.num_swapped_out_blocks
    assert _all_free(llm)


@pytest.mark.parametrize("mode", ["auto", "swap", "recompute"])
def test_preemption_with_parallel_sampling_groups(model_dir, mode):
    prompts = random_prompts(6, 256, 10, 40, seed=3)
    params = [
        SamplingParams(n=3, temperature=0.8, seed=i, max_tokens=20, ignore_eos=True)
        if i % 2 == 0
        else GREEDY
        for i in range(len(prompts))
    ]
    big = LLM(model_dir, device="cpu", dtype="float32", num_kv_blocks=512)
    ref = big.generate(prompt_token_ids=prompts, sampling_params=params)
    small = LLM(
        model_dir,
        device="cpu",
        dtype="float32",
        block_size=8,
        num_kv_blocks=20,
        preemption_mode=mode,
        watermark=0.0,
    )
    outputs = small.generate(prompt_token_ids=prompts, sampling_params=params)
    assert _tokens(outputs) == _tokens(ref)
    assert small.engine.get_stats().num_preemptions > 0
    assert _all_free(small)


def test_swap_round_trip_restores_kv_exactly(model_dir):
    llm = LLM(model_dir, device="cpu", dtype="float32", num_kv_blocks=16)
    runner = llm.engine.runner
    runner.kv_cache.copy_(torch.randn_like(runner.kv_cache))
    before = runner.kv_cache[[3, 7]].clone()
    from pydaemon.core.sched.scheduler import SchedulerOutput

    runner.kv_transfer.move(SchedulerOutput(blocks_to_swap_out=[(3, 0), (7, 1)]))
    runner.kv_cache[[3, 7]] = 0
    runner.kv_transfer.move(SchedulerOutput(blocks_to_swap_in=[(0, 10), (1, 12)]))
    assert torch.equal(runner.kv_cache[[10, 12]], before)


def test_prefix_cache_skips_work_and_keeps_outputs(model_dir):
    shared = random_prompts(1, 256, 64, 64, seed=9)[0]
    prompts = [shared + [10 + i] for i in range(3)]
    llm = LLM(model_dir, device="cpu", dtype="float32", block_size=16, num_kv_blocks=128)
    first = llm.generate(prompt_token_ids=prompts[:1], sampling_params=GREEDY)
    computed_first = llm.engine.num_prompt_tokens
    rest = llm.generate(prompt_token_ids=prompts[1:], sampling_params=GREEDY)
    computed_rest = llm.engine.num_prompt_tokens - computed_first
    stats = llm.engine.get_stats()
    assert stats.prefix_cache_hit_tokens >= 2 * 64
    assert computed_rest < 2 * len(prompts[1])  # the 64 shared tokens were not recomputed
    nocache = LLM(
        model_dir, device="cpu", dtype="float32", num_kv_blocks=128, enable_prefix_caching=False
    )
    ref = nocache.generate(prompt_token_ids=prompts, sampling_params=GREEDY)
    assert _tokens(first + rest) == _tokens(ref)
    assert rest[0].metrics.num_cached_tokens == 64


def test_cache_salt_isolates_tenants(model_dir):
    prompt = random_prompts(1, 256, 49, 49, seed=4)[0]  # 3 full blocks + 1
    llm = LLM(model_dir, device="cpu", dtype="float32", num_kv_blocks=128)
    llm.generate(prompt_token_ids=[prompt], sampling_params=GREEDY, cache_salt="tenant-a")
    hits = llm.engine.get_stats().prefix_cache_hit_tokens
    llm.generate(prompt_token_ids=[prompt], sampling_params=GREEDY, cache_salt="tenant-b")
    assert llm.engine.get_stats().prefix_cache_hit_tokens == hits
    llm.generate(prompt_token_ids=[prompt], sampling_params=GREEDY, cache_salt="tenant-a")
    assert llm.engine.get_stats().prefix_cache_hit_tokens == hits + 48


def test_parallel_sampling_shares_prompt_blocks(model_dir):
    llm = LLM(model_dir, device="cpu", dtype="float32", block_size=8, num_kv_blocks=64)
    engine = llm.engine
    prompt = random_prompts(1, 256, 21, 21, seed=8)[0]  # 2 full blocks + 5 tokens
    params = SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=6, ignore_eos=True)
    engine.add_request(GenerateRequest("p", prompt, params))
    engine.step()  # prefill + fork into 4 sequences
    request = engine.requests["p"]
    assert len(request.seqs) == 4
    bm = engine.block_manager
    tables = [bm.block_table(s.seq_id) for s in request.seqs]
    assert all(t == tables[0] for t in tables)
    assert [bm.ref_count(b) for b in tables[0]] == [4, 4, 4]
    engine.step()  # first append: the partly filled block is copied on write
    tables = [bm.block_table(s.seq_id) for s in request.seqs]
    assert all(t[:2] == tables[0][:2] for t in tables)
    assert len({t[2] for t in tables}) == 4
    assert bm.num_shared_blocks() == 2
    while engine.has_unfinished_requests():
        engine.step()
    assert _all_free(llm)
    again = llm.generate(prompt_token_ids=[prompt], sampling_params=params)[0]
    first = LLM(model_dir, device="cpu", dtype="float32", num_kv_blocks=64).generate(
        prompt_token_ids=[prompt], sampling_params=params
    )[0]
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in first.outputs]
    assert len({tuple(c.token_ids) for c in first.outputs}) > 1
