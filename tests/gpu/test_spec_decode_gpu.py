"""Speculative decoding on a GPU with the pagedd kernels (fp16): verify steps (eager, prefill
kernel over k + 1 new tokens) beside graphed decode steps keep greedy output on float32's
argmax; rejected drafts' blocks are returned; n-gram drafts on a repetitive prompt are
accepted; the sampled path runs on the device (seeded runs repeat)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from engine_utils import all_blocks_free, gaps_of_outputs, make_hf_model, random_prompts  # noqa: E402

from pydaemon import LLM, SamplingParams  # noqa: E402
from pydaemon.worker.spec_decode.oracle_proposer import OracleProposer  # noqa: E402

GREEDY = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
SPEC = {"method": "ngram", "num_speculative_tokens": 4}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_hf_model(
        tmp_path_factory.mktemp("spec_gpu"),
        hidden_size=512,
        num_heads=8,
        num_kv_heads=2,
        num_layers=2,
        vocab_size=512,
        seed=1,
    )


def _llm(path, spec=None, **kw):
    return LLM(str(path), device="cuda", dtype="float16", num_kv_blocks=256,
               speculative_config=spec, **kw)  # fmt: skip


@pytest.mark.parametrize("block_size", [8, 16])
def test_oracle_drafts_follow_fp32_argmax(model, block_size):
    path, hf = model
    prompts = random_prompts(6, 512, 5, 200, seed=block_size)
    plain = _llm(path, block_size=block_size).generate(
        prompt_token_ids=prompts, sampling_params=GREEDY
    )
    refs = [p + o.outputs[0].token_ids for p, o in zip(prompts, plain, strict=True)]
    llm = _llm(path, SPEC, block_size=block_size)
    llm.engine.runner.spec_decoder.proposer = OracleProposer(refs, 5, 512)
    outputs = llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY)
    hf32 = hf.to("cuda", torch.float32)
    gaps = gaps_of_outputs(hf32, prompts, outputs)
    assert float(gaps.max()) < 0.05, f"largest gap {float(gaps.max()):.3f} logit std"
    same = [
        a.outputs[0].token_ids == b.outputs[0].token_ids
        for a, b in zip(outputs, plain, strict=True)
    ]
    assert sum(same) >= len(same) - 1  # fp16 near-ties between the two kernels aside
    stats = llm.engine.core.get_stats().spec_decode
    assert stats.num_accepted_tokens > stats.num_draft_tokens // 2
    assert all_blocks_free(llm)


def test_ngram_on_a_repetitive_prompt_is_accepted(model):
    path, _ = model
    phrase = random_prompts(1, 512, 12, 13, seed=9)[0]
    prompt = phrase * 6
    llm = _llm(path, SPEC)
    out = llm.generate(prompt_token_ids=[prompt], sampling_params=GREEDY)[0]
    plain = _llm(path).generate(prompt_token_ids=[prompt], sampling_params=GREEDY)[0]
    assert out.outputs[0].token_ids[:16] == plain.outputs[0].token_ids[:16]
    assert llm.engine.core.get_stats().spec_decode.num_draft_tokens > 0
    assert all_blocks_free(llm)


def test_seeded_sampling_repeats_on_the_device(model):
    path, _ = model
    prompts = random_prompts(4, 512, 8, 40, seed=2)
    params = SamplingParams(temperature=0.9, top_p=0.9, seed=11, max_tokens=32, ignore_eos=True)
    runs = []
    for _ in range(2):
        llm = _llm(path, SPEC)
        llm.engine.runner.spec_decoder.proposer = OracleProposer([p + p for p in prompts], 0, 512)
        runs.append(
            [
                o.outputs[0].token_ids
                for o in llm.generate(prompt_token_ids=prompts, sampling_params=params)
            ]
        )
        assert all_blocks_free(llm)
    assert runs[0] == runs[1]


def test_draft_model_on_gpu_follows_fp32_argmax(model):
    """The target as its own draft: drafts mostly right (fp16 decode vs prefill kernels may
    flip near-ties); the output stays on float32's argmax; its KV share leaves no leak."""
    path, hf = model
    prompts = random_prompts(4, 512, 10, 120, seed=5)
    spec = {"method": "draft_model", "model": str(path), "num_speculative_tokens": 3}
    llm = _llm(path, spec)
    outputs = llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY)
    hf32 = hf.to("cuda", torch.float32)
    gaps = gaps_of_outputs(hf32, prompts, outputs)
    assert float(gaps.max()) < 0.05, f"largest gap {float(gaps.max()):.3f} logit std"
    assert llm.engine.core.get_stats().spec_decode.acceptance_rate > 0.8
    assert all_blocks_free(llm)
