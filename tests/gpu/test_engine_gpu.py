"""The engine on a GPU with the pagedd kernels in use (fp16): greedy equality with
transformers, and swap / copy-on-write through the kernels keep outputs exact."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from engine_utils import all_blocks_free, gaps_of_outputs, make_hf_model, random_prompts  # noqa: E402

from pydaemon import LLM, SamplingParams  # noqa: E402
from pydaemon.layers.attention import uses_kernels  # noqa: E402

GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    # head_dim 64: a kernel head size; GQA 8 query heads over 2 KV heads.
    return make_hf_model(
        tmp_path_factory.mktemp("gpu"),
        hidden_size=512,
        num_heads=8,
        num_kv_heads=2,
        num_layers=2,
        vocab_size=512,
        seed=1,
    )


@pytest.mark.parametrize("backend", ["auto", "torch"])
@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_fp16_greedy_follows_transformers_fp32_with_kernels(
    model, block_size, backend, monkeypatch
):
    from pydaemon.layers import attention

    monkeypatch.setattr(attention, "BACKEND", backend)
    path, hf = model
    prompts = random_prompts(6, 512, 5, 300, seed=block_size)
    llm = LLM(str(path), device="cuda", dtype="float16", block_size=block_size, num_kv_blocks=256)
    assert uses_kernels(llm.engine.runner.kv_cache) == (backend == "auto")
    outputs = llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY)
    hf32 = hf.to("cuda", torch.float32)
    gaps = gaps_of_outputs(hf32, prompts, outputs)
    # Greedy in fp16 follows float32's argmax except at near-ties (gap < 5% of a logit std).
    assert float(gaps.max()) < 0.05, f"largest gap {float(gaps.max()):.3f} logit std"
    assert float((gaps == 0).float().mean()) > 0.9
    assert all_blocks_free(llm)


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_preemption_on_gpu_keeps_outputs(model, mode):
    path, _ = model
    prompts = random_prompts(8, 512, 20, 90, seed=3)
    params = [
        SamplingParams(n=3, temperature=0.9, seed=i, max_tokens=24, ignore_eos=True)
        if i % 2
        else GREEDY
        for i in range(len(prompts))
    ]
    big = LLM(str(path), device="cuda", dtype="float16", block_size=16, num_kv_blocks=512)
    ref = big.generate(prompt_token_ids=prompts, sampling_params=params)
    small = LLM(
        str(path),
        device="cuda",
        dtype="float16",
        block_size=16,
        num_kv_blocks=24,
        preemption_mode=mode,
        watermark=0.0,
    )
    outputs = small.generate(prompt_token_ids=prompts, sampling_params=params)
    assert [[c.token_ids for c in o.outputs] for o in outputs] == [
        [c.token_ids for c in o.outputs] for o in ref
    ]
    stats = small.engine.get_stats()
    assert stats.num_preemptions > 0
    if mode == "swap":
        assert stats.num_swapped_out_blocks > 0
    assert all_blocks_free(small)
