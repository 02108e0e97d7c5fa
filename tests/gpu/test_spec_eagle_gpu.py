"""EAGLE-1 speculative decoding on a GPU (fp16, CUDA graphs: decode steps, and verify graphs
whose output buffer holds the hidden states the head reads): an exact head on a target
whose next token depends only on the current one is accepted nearly always and the output
stays on float32's argmax; a random head's drafts follow the float64 EAGLE-1 reference
recomputed from the target's float32 hidden states (near-ties aside); no block leaks."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from eagle_utils import head_tensors, make_exact_eagle, reference_drafts, save_head  # noqa: E402
from engine_utils import (  # noqa: E402
    all_blocks_free,
    gaps_of_outputs,
    make_hf_model,
    random_prompts,
)

from pydaemon import LLM, SamplingParams  # noqa: E402

SHAPE = dict(hidden_size=512, num_heads=8, num_kv_heads=2, vocab_size=512)
GREEDY = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)


def _llm(path, head_dir=None, k=4, **kw):
    spec = (
        None
        if head_dir is None
        else {"method": "eagle", "model": str(head_dir), "num_speculative_tokens": k}
    )
    return LLM(str(path), device="cuda", dtype="float16", num_kv_blocks=256,
               speculative_config=spec, **kw)  # fmt: skip


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_exact_head_is_accepted_and_follows_fp32_argmax(tmp_path, async_scheduling):
    path, hf, heads = make_exact_eagle(tmp_path, noises=(0.0,), **SHAPE)
    prompts = random_prompts(6, 512, 5, 200, seed=3)
    llm = _llm(path, heads[0.0][0], async_scheduling=async_scheduling)
    outputs = llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY)
    hf32 = hf.to("cuda", torch.float32)
    gaps = gaps_of_outputs(hf32, prompts, outputs)
    assert float(gaps.max()) < 0.05, f"largest gap {float(gaps.max()):.3f} logit std"
    stats = llm.engine.core.get_stats().spec_decode
    assert stats.num_draft_tokens > 100 and stats.acceptance_rate > 0.9
    assert llm.engine.runner.cuda_graphs.num_verify_replays > 0
    assert all_blocks_free(llm)


def test_random_head_drafts_follow_the_reference(tmp_path):
    path, hf = make_hf_model(tmp_path / "target", num_layers=2, seed=1, **SHAPE)
    w = head_tensors(512, 512, num_heads=8, num_kv_heads=2, seed=4)
    head_dir = save_head(tmp_path / "head", w, 512, 512, num_heads=8, num_kv_heads=2)
    llm = _llm(path, head_dir, k=3)
    calls = []
    proposer = llm.engine.runner.spec_decoder.proposer
    propose = proposer.propose

    def spy(requests):
        drafts = propose(requests)
        calls.extend((r.token_ids.tolist(), d) for r, d in zip(requests, drafts, strict=True))
        return drafts

    proposer.propose = spy
    prompts = random_prompts(4, 512, 10, 120, seed=5)
    llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY)
    hf = hf.to("cuda", torch.float32)
    embed, lm = hf.model.embed_tokens.weight.cpu(), hf.lm_head.weight.cpu()
    same = total = 0
    for tokens, drafts in calls[::4]:
        with torch.no_grad():
            hidden = hf.model(input_ids=torch.tensor([tokens], device="cuda")).last_hidden_state
        want = reference_drafts(w, embed, lm, tokens, hidden[0].cpu(), len(drafts), 0.05,
                                num_heads=8, num_kv_heads=2)  # fmt: skip
        same += sum(a == b for a, b in zip(drafts, want, strict=False))
        total += len(want)
    assert total > 30 and same >= 0.9 * total, (same, total)
    assert all_blocks_free(llm)
