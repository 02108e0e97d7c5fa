"""SamplingParams.prompt_logprobs (vLLM's): each prompt token's log-probability given the
tokens before it, with its top-k alternatives, against a float64 transformers reference;
through chunked prefill, a prefix-cache hit, n > 1 and alongside plain requests (issue 46)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from pydaemon import LLM, SamplingParams

sys.path.insert(0, str(Path(__file__).parent))
from engine_utils import make_hf_model  # noqa: E402

PROMPT = [5, 9, 33, 71, 2 + 100, 17, 17, 40, 8, 99, 120, 3, 64, 64, 7, 200, 11, 12, 250, 30]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_hf_model(tmp_path_factory.mktemp("pl") / "m")


@torch.no_grad()
def _reference(hf, prompt: list[int]) -> torch.Tensor:
    """[len(prompt) - 1, vocab] float64: log p(prompt[i + 1] | prompt[: i + 1]) rows."""
    logits = hf.double()(input_ids=torch.tensor([prompt]), use_cache=False).logits[0]
    return logits[:-1].log_softmax(-1)


def _check(prompt_logprobs, reference: torch.Tensor, prompt: list[int], k: int) -> None:
    assert prompt_logprobs[0] is None and len(prompt_logprobs) == len(prompt)
    for i, entry in enumerate(prompt_logprobs[1:]):
        row = reference[i]
        target = prompt[i + 1]
        assert entry[target] == pytest.approx(float(row[target]), abs=2e-4)
        top = row.topk(k).indices.tolist()
        assert set(entry) == {target, *top}, (i, entry, top)
        for token_id, value in entry.items():
            assert value == pytest.approx(float(row[token_id]), abs=2e-4)


@pytest.mark.parametrize("max_num_batched_tokens", [512, 8])  # one prefill, or chunks of 8
def test_prompt_logprobs_against_float64(model, max_num_batched_tokens):
    path, hf = model
    llm = LLM(
        str(path), device="cpu", dtype="float32", num_kv_blocks=64,
        max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=4,
    )  # fmt: skip
    reference = _reference(hf, PROMPT)
    params = SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=3)
    plain = SamplingParams(temperature=0, max_tokens=3)
    outs = llm.generate(prompt_token_ids=[PROMPT, PROMPT[:7], PROMPT], sampling_params=[
        params, plain, SamplingParams(temperature=1.0, n=2, seed=1, max_tokens=2,
                                      prompt_logprobs=0)])  # fmt: skip
    _check(outs[0].prompt_logprobs, reference, PROMPT, 3)
    assert outs[1].prompt_logprobs is None
    _check(outs[2].prompt_logprobs, reference, PROMPT, 0)  # n = 2: once per request
    # The same prompt again: the prefix cache would have served it; every position is there.
    again = llm.generate(prompt_token_ids=[PROMPT], sampling_params=params)[0]
    _check(again.prompt_logprobs, reference, PROMPT, 3)
    # the outputs are unchanged by asking
    assert (
        again.outputs[0].token_ids
        == llm.generate(prompt_token_ids=[PROMPT], sampling_params=plain)[0].outputs[0].token_ids
    )


def test_prompt_logprobs_bounds():
    """Negative counts are refused here; the upper bound is the engine's --max-logprobs
    (tests/server/test_max_logprobs.py), so SamplingParams takes more than 20."""
    assert SamplingParams(prompt_logprobs=21).prompt_logprobs == 21
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=-1)


def test_a_recomputed_prefill_sends_each_position_once():
    """After a preemption by recompute the prompt is prefilled again: positions already sent
    are not sent twice (SeqUpdater._add_prompt_logprobs)."""
    from pydaemon.core.request import Request
    from pydaemon.core.sched.seq_updates import SeqUpdater

    request = Request("r", list(range(10)), SamplingParams(prompt_logprobs=0), set())
    outputs: dict = {}
    chunk = [{p: -float(p)} for p in range(1, 6)]  # positions 1..5
    SeqUpdater._add_prompt_logprobs(request, 1, chunk, outputs)
    SeqUpdater._add_prompt_logprobs(request, 1, chunk, outputs)  # the recompute: nothing new
    later = [{p: -float(p)} for p in range(4, 10)]  # positions 4..9: 6..9 are new
    SeqUpdater._add_prompt_logprobs(request, 4, later, outputs)
    sent = outputs["r"].new_prompt_logprobs
    assert [next(iter(e)) for e in sent] == list(range(1, 10))
    assert request.num_prompt_logprobs == 9


def test_prompt_logprobs_beside_speculative_decoding(model):
    """A prefill chunk may share a step with verified drafts (their rows come first in the
    prefill group): the prompt's positions all come back, against the float64 reference."""
    path, hf = model
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2,
            "disable_by_batch_size": 64, "auto_disable": False}  # fmt: skip
    llm = LLM(str(path), device="cpu", dtype="float32", num_kv_blocks=64,
              max_num_batched_tokens=16, max_num_seqs=4, speculative_config=spec)  # fmt: skip
    repeat = [5, 9, 5, 9, 5, 9, 5, 9]  # n-gram drafts find matches in it
    params = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)] * 2 + [
        SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=2)
    ]
    outs = llm.generate(prompt_token_ids=[repeat, repeat[:6], PROMPT], sampling_params=params)
    _check(outs[2].prompt_logprobs, _reference(hf, PROMPT), PROMPT, 2)
