"""EAGLE-1 speculative decoding on CPU (tiny random Llama target, float32): the head's forward
against a plain-torch float64 reference of the published math; every draft the engine
proposes against that reference recomputed from the target's hidden states (chunked prefill,
verify steps with rejections, async scheduling); greedy tokens equal to decoding without
speculation through stops, max_tokens and preemption; a head built to be exactly right
accepted every time; clear start-up errors for bad heads; every KV block back."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from eagle_utils import (
    head_tensors,
    make_exact_eagle,
    reference_drafts,
    reference_head,
    save_head,
)
from engine_utils import all_blocks_free, make_hf_model, random_prompts

from pydaemon import LLM, SamplingParams
from pydaemon.layers.attention_metadata import chunk_metadata
from pydaemon.model_loader.eagle_head import load_eagle_head
from pydaemon.model_loader.loader import load_model
from pydaemon.worker.kv_cache import KVCacheSpec

VOCAB, HIDDEN = 256, 64
CPU = torch.device("cpu")
NOISE = 0.006  # the noisy head's (eagle_utils.make_exact_eagle): some drafts rejected


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return make_hf_model(tmp_path_factory.mktemp("eagle_target"), vocab_size=VOCAB)


@pytest.fixture(scope="module")
def head(tmp_path_factory):
    tensors = head_tensors(HIDDEN, VOCAB, seed=1)
    return save_head(tmp_path_factory.mktemp("eagle_head"), tensors, HIDDEN, VOCAB), tensors


def _spec(head_dir, k=3, **extra) -> dict:
    return {"method": "eagle", "model": str(head_dir), "num_speculative_tokens": k, **extra}


def _llm(model, spec=None, **kwargs) -> LLM:
    kwargs.setdefault("num_kv_blocks", 64)
    return LLM(str(model), device="cpu", dtype="float32", speculative_config=spec, **kwargs)


def _stats(llm: LLM):
    return llm.engine.core.get_stats().spec_decode


def _tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def _proposer(llm: LLM):
    return llm.engine.runner.spec_decoder.proposer


def test_head_forward_matches_the_reference(target, head, tmp_path):
    """Two chunks through the paged cache (the second attends over the first's K/V) equal
    the float64 reference over the whole sequence at once, with a checkpoint that brings
    its own embedding and LM head (used, since they differ from the target's)."""
    path, _ = target
    tensors = head_tensors(HIDDEN, VOCAB, seed=3, embed=True, lm_head=True)
    head_dir = save_head(tmp_path / "own", tensors, HIDDEN, VOCAB)
    model, mc = load_model(path, dtype="float32")
    for head_path, w in ((head[0], head[1]), (head_dir, tensors)):
        loaded = load_eagle_head(head_path, model, mc, "float32", CPU)
        has_own = "embed_tokens.weight" in w
        assert (loaded.embed_tokens is model.model.embed_tokens) == (not has_own)
        assert (loaded.lm_head_weight is None) == (not has_own)
        cache = KVCacheSpec(1, 2, 8, HIDDEN // 4, torch.float32).allocate(6, CPU)
        table = np.array([4, 0, 5, 2, 1], dtype=np.int32)  # scattered blocks
        t = 29
        ids = torch.randint(3, VOCAB, (t,), generator=torch.Generator().manual_seed(5))
        hidden = torch.randn(t, HIDDEN, generator=torch.Generator().manual_seed(6))
        embeds = loaded.embed_tokens(ids)
        outs = []
        with torch.inference_mode():
            for start, n in ((0, 13), (13, 16)):
                meta, pos = chunk_metadata([table], np.array([start]), np.array([n]), 8, CPU)
                rows = slice(start, start + n)
                outs.append(
                    loaded.head(embeds[rows], hidden[rows], torch.from_numpy(pos), cache, meta)
                )
        want = reference_head(w, embeds, hidden)
        torch.testing.assert_close(torch.cat(outs).double(), want, atol=2e-5, rtol=1e-4)


def _spy_drafts(llm: LLM) -> list[tuple[list[int], list[int]]]:
    """Records (tokens, drafts) of every sequence the proposer was asked to draft for, and
    checks it drafted all it was asked: its state always followed the sequence."""
    proposer = _proposer(llm)
    calls: list[tuple[list[int], list[int]]] = []
    propose = proposer.propose

    def spy(requests):
        drafts = propose(requests)
        assert [len(d) for d in drafts] == [r.max_drafts for r in requests]
        calls.extend((r.token_ids.tolist(), d) for r, d in zip(requests, drafts, strict=True))
        return drafts

    proposer.propose = spy
    return calls


def _check_against_reference(calls, hf, w, min_checked: int) -> None:
    embed, lm = hf.model.embed_tokens.weight.detach(), hf.lm_head.weight.detach()
    checked = 0
    for tokens, drafts in calls:
        with torch.no_grad():
            hidden = hf.model(input_ids=torch.tensor([tokens])).last_hidden_state[0]
        want = reference_drafts(w, embed, lm, tokens, hidden, len(drafts))
        assert drafts[: len(want)] == want, (len(tokens), drafts, want)
        checked += len(want)
    assert checked >= min_checked


def _setup(request, which: str):
    """(target dir, transformers model, head dir, head tensors): a random head on the random
    target (drafts rejected), or the noisy head on the exact target (some accepted)."""
    if which == "random":
        (path, hf), (head_dir, w) = (
            request.getfixturevalue("target"),
            request.getfixturevalue("head"),
        )
        return path, hf, head_dir, w
    path, hf, heads = request.getfixturevalue("exact")
    return path, hf, *heads[NOISE]


@pytest.mark.parametrize("which", ["random", "noisy"])
def test_drafts_equal_the_reference_through_chunks_and_verify_steps(request, which):
    """Every draft the engine proposes equals EAGLE-1's chain recomputed from the target's
    hidden states (transformers' model): the head caught up on chunked prompts (a 16-token
    budget), on plain decodes and on verify steps (their accepted rows only)."""
    path, hf, head_dir, w = _setup(request, which)
    prompts = random_prompts(4, VOCAB, 20, 40, seed=11)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    llm = _llm(
        path,
        _spec(head_dir),
        max_num_batched_tokens=16,
        max_num_seqs=4,
        enable_prefix_caching=False,
    )
    calls = _spy_drafts(llm)
    plain = _tokens(_llm(path).generate(prompt_token_ids=prompts, sampling_params=params))
    assert _tokens(llm.generate(prompt_token_ids=prompts, sampling_params=params)) == plain
    stats = _stats(llm)
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens < stats.num_draft_tokens
    assert (stats.num_accepted_tokens > 0) == (which == "noisy")
    _check_against_reference(calls, hf, w, min_checked=40)
    assert all_blocks_free(llm)


@pytest.mark.parametrize("which", ["random", "noisy"])
def test_greedy_matches_plain_with_stops_max_tokens_and_preemption(request, which):
    path, _, head_dir, _ = _setup(request, which)
    prompts = random_prompts(5, VOCAB, 20, 40, seed=12)
    base = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    plain = _tokens(_llm(path).generate(prompt_token_ids=prompts, sampling_params=base))
    params = [
        SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, stop_token_ids=[r[9]])
        for r in plain[:2]
    ] + [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (7, 30, 40)]
    # 14 blocks of 8 tokens cannot hold five 30- to 80-token sequences: preemption.
    kwargs = dict(block_size=8, num_kv_blocks=14)
    for mode in ("recompute", "swap"):
        want = _tokens(
            _llm(path, preemption_mode=mode, **kwargs).generate(
                prompt_token_ids=prompts, sampling_params=params
            )
        )
        assert [len(w) for w in want[2:]] == [7, 30, 40]
        llm = _llm(path, _spec(head_dir, k=4), preemption_mode=mode, **kwargs)
        assert _tokens(llm.generate(prompt_token_ids=prompts, sampling_params=params)) == want
        assert llm.engine.core.scheduler.stats.num_preemptions > 0
        stats = _stats(llm)
        assert stats.num_draft_tokens > 0
        assert (stats.num_accepted_tokens > 0) == (which == "noisy")  # runs cut by stops
        assert all_blocks_free(llm)


@pytest.mark.parametrize("which", ["random", "noisy"])
def test_async_scheduling_drafts_equal_the_reference(request, which):
    """Async scheduling: overlapped steps (above disable_by_batch_size) feed the head tokens
    that were placeholders on the host; the drafts of the later synchronous steps still
    equal the reference, and greedy tokens equal plain decoding."""
    path, hf, head_dir, w = _setup(request, which)
    prompts = random_prompts(6, VOCAB, 8, 20, seed=13)
    lengths = [6, 8, 10, 24, 28, 30]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths]
    plain = _tokens(_llm(path).generate(prompt_token_ids=prompts, sampling_params=params))
    spec = _spec(head_dir, disable_by_batch_size=3)
    llm = _llm(path, spec, async_scheduling=True, enable_prefix_caching=False)
    calls = _spy_drafts(llm)
    assert _tokens(llm.generate(prompt_token_ids=prompts, sampling_params=params)) == plain
    assert llm.engine.core.async_stepper.num_overlapped_steps > 0
    _check_against_reference(calls, hf, w, min_checked=20)
    assert all_blocks_free(llm)


@pytest.fixture(scope="module")
def exact(tmp_path_factory):
    """eagle_utils.make_exact_eagle: a target and heads drafting it exactly (noise 0) or
    nearly (NOISE)."""
    return make_exact_eagle(tmp_path_factory.mktemp("eagle_exact"), (0.0, NOISE))


def test_an_exact_head_is_always_accepted(exact):
    path, _, heads = exact
    prompts = random_prompts(4, VOCAB, 5, 15, seed=14)
    params = SamplingParams(temperature=0.0, max_tokens=25, ignore_eos=True)
    plain = _tokens(_llm(path).generate(prompt_token_ids=prompts, sampling_params=params))
    llm = _llm(path, _spec(heads[0.0][0], k=4))
    assert _tokens(llm.generate(prompt_token_ids=prompts, sampling_params=params)) == plain
    stats = _stats(llm)
    assert stats.num_draft_tokens >= 40
    assert stats.num_accepted_tokens == stats.num_draft_tokens
    assert all_blocks_free(llm)


def _bad_head(tmp_path, change=None, drop=(), **config):
    tensors = head_tensors(HIDDEN, VOCAB, seed=2)
    if change:
        tensors.update(change)
    for name in drop:
        del tensors[name]
    hidden = config.pop("hidden_size", HIDDEN)
    vocab = config.pop("vocab_size", VOCAB)
    return save_head(tmp_path / "bad", tensors, hidden, vocab, **config)


@pytest.mark.parametrize(
    "change,drop,config,message",
    [
        (None, ("fc.weight",), {}, "has no fc.weight, so it is not an EAGLE head"),
        ({"fc.weight": torch.zeros(HIDDEN, 3 * HIDDEN)}, (), {}, "EAGLE-3 head.*eagle3"),
        ({"fc.weight": torch.zeros(HIDDEN, HIDDEN)}, (), {}, r"fc.weight is \[64, 64\]"),
        (None, (), {"hidden_size": 32}, "hidden_size 32, the target's 64"),
        (None, (), {"vocab_size": 128}, "vocabulary of 128 tokens"),
        ({"embed_tokens.weight": torch.zeros(128, HIDDEN)}, (), {}, "embed_tokens.*vocabulary"),
        (None, ("layers.0.mlp.up_proj.weight",), {}, "missing tensors.*up_proj"),
    ],
)
def test_bad_heads_fail_at_start_up(target, tmp_path, change, drop, config, message):
    head_dir = _bad_head(tmp_path, change, drop, **config)
    with pytest.raises(ValueError, match=message):
        _llm(target[0], _spec(head_dir))


def test_head_without_weights_or_model_key(target, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.json").write_text((_bad_head(tmp_path) / "config.json").read_text())
    with pytest.raises(FileNotFoundError, match="no weights"):
        _llm(target[0], _spec(empty))
    with pytest.raises(ValueError, match="must name the EAGLE head"):
        _llm(target[0], {"method": "eagle", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="eagle3 is not supported"):
        _llm(target[0], {"method": "eagle3", "model": str(empty), "num_speculative_tokens": 2})


def test_pytorch_bin_heads_with_a_model_prefix_load_alike(target, head, tmp_path):
    """The published EAGLE-1 heads ship pytorch_model.bin; some name tensors model.*."""
    path, _ = target
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "config.json").write_text((head[0] / "config.json").read_text())
    torch.save({f"model.{k}": v for k, v in head[1].items()}, bin_dir / "pytorch_model.bin")
    model, mc = load_model(path, dtype="float32")
    a = load_eagle_head(head[0], model, mc, "float32", CPU).head.state_dict()
    b = load_eagle_head(bin_dir, model, mc, "float32", CPU).head.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
