"""Speculative decoding end to end on CPU (tiny random Llama, float32): greedy tokens equal
to decoding without it (n-gram and an oracle proposer with planted wrong drafts), through
preemption, prefix-cache hits, stop ids / stop strings / max_tokens inside an accepted run;
sampled output from the same distribution (chi-square); requests that must not speculate;
blocks back to full after every test."""

from __future__ import annotations

import numpy as np
import pytest
from engine_utils import all_blocks_free, make_hf_model, random_prompts

from pydaemon import LLM, SamplingParams
from pydaemon.worker.spec_decode.oracle_proposer import OracleProposer
from pydaemon.worker.spec_decode.proposer import DraftRequest
from pydaemon.worker.spec_decoder import _padded

VOCAB = 256
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path, _ = make_hf_model(tmp_path_factory.mktemp("spec_llama"), vocab_size=VOCAB)
    return path


def _llm(model, spec=None, **kwargs) -> LLM:
    kwargs.setdefault("num_kv_blocks", 64)
    return LLM(str(model), device="cpu", dtype="float32", speculative_config=spec, **kwargs)


def _runner(llm: LLM):
    return llm.engine.runner


def _stats(llm: LLM):
    return llm.engine.core.get_stats().spec_decode


def _tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def _repetitive_prompts(count: int, seed: int) -> list[list[int]]:
    """Prompts that repeat a phrase: n-gram lookup finds drafts in them."""
    rng = np.random.default_rng(seed)
    prompts = []
    for _ in range(count):
        phrase = rng.integers(3, VOCAB, size=int(rng.integers(3, 7))).tolist()
        prompts.append(phrase * 3 + rng.integers(3, VOCAB, size=2).tolist() + phrase[:2])
    return prompts


GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)


def test_ngram_greedy_matches_plain(model):
    prompts = _repetitive_prompts(6, seed=1) + random_prompts(2, VOCAB, 5, 20, seed=2)
    plain = _tokens(_llm(model).generate(prompt_token_ids=prompts, sampling_params=GREEDY))
    llm = _llm(model, NGRAM)
    assert _tokens(llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY)) == plain
    stats = _stats(llm)
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens > 0
    assert stats.num_accepted_tokens < stats.num_draft_tokens  # rejections were exercised
    assert stats.accepted_per_position[0] >= stats.accepted_per_position[-1]
    assert all_blocks_free(llm)


def test_padded_drafts_match_plain_and_fill_every_decode(model):
    """Where verify graphs exist, a decode-only step's drafts are padded to k for every
    sequence (pad_drafts, forced on here on the CPU): greedy tokens do not change, and such
    steps verify k drafts for every sequence, also for those the proposer found nothing for."""
    prompts = _repetitive_prompts(5, seed=4) + random_prompts(3, VOCAB, 5, 20, seed=5)
    plain = _tokens(_llm(model).generate(prompt_token_ids=prompts, sampling_params=GREEDY))
    k = NGRAM["num_speculative_tokens"]
    full_steps = {}
    for pad in (False, True):
        llm = _llm(model, NGRAM)
        decoder = _runner(llm).spec_decoder
        decoder.pad_drafts = pad
        plans = []
        propose = decoder.propose

        def spy(out, propose=propose, plans=plans):
            plans.append(propose(out))
            return plans[-1]

        decoder.propose = spy
        assert _tokens(llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY)) == plain
        full_steps[pad] = sum(
            plan is not None
            and len(plan.drafts) == len(plan.out.num_scheduled_tokens)
            and all(len(d) == k for d in plan.drafts.values())
            for plan in plans
        )
        assert all_blocks_free(llm)
    assert full_steps[True] > full_steps[False]


def test_padding_needs_a_decode_only_step_with_k_slots_each(model):
    llm = _llm(model, NGRAM)
    decoder = _runner(llm).spec_decoder
    decoder.pad_drafts = True
    k = NGRAM["num_speculative_tokens"]
    tokens = np.array([5, 6, 7, 5, 6], dtype=np.int32)

    class Out:  # the SchedulerOutput fields the check reads
        def __init__(self, num_prefills, scheduled):
            self.num_prefills, self.num_scheduled_tokens = num_prefills, scheduled

    full = [DraftRequest(1, tokens, k), DraftRequest(2, tokens, k)]
    assert decoder._fills_a_verify_graph(Out(0, {1: 1, 2: 1}), full)
    assert not decoder._fills_a_verify_graph(Out(1, {0: 9, 1: 1, 2: 1}), full)  # a prefill
    assert not decoder._fills_a_verify_graph(Out(0, {1: 1, 2: 1, 3: 1}), full)  # no slots
    capped = [DraftRequest(1, tokens, k), DraftRequest(2, tokens, k - 1)]  # near max_tokens
    assert not decoder._fills_a_verify_graph(Out(0, {1: 1, 2: 1}), capped)
    assert _padded(DraftRequest(1, tokens, k), [7]) == [7] * k
    assert _padded(DraftRequest(1, tokens, k), []) == [6] * k


def _oracle_llm(model, prompts, references, corrupt_every=3, **kwargs) -> LLM:
    llm = _llm(model, {"method": "ngram", "num_speculative_tokens": 5}, **kwargs)
    full = [p + r for p, r in zip(prompts, references, strict=True)]
    _runner(llm).spec_decoder.proposer = OracleProposer(full, corrupt_every, VOCAB)
    return llm


def test_oracle_runs_match_plain_with_rejections(model):
    prompts = random_prompts(5, VOCAB, 4, 30, seed=3)
    plain = _tokens(_llm(model).generate(prompt_token_ids=prompts, sampling_params=GREEDY))
    llm = _oracle_llm(model, prompts, plain, corrupt_every=4)
    assert _tokens(llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY)) == plain
    stats = _stats(llm)
    assert stats.num_accepted_tokens > stats.num_drafts  # more than one per verify step
    assert stats.num_accepted_tokens < stats.num_draft_tokens
    assert all_blocks_free(llm)


def test_stop_ids_and_max_tokens_inside_a_run(model):
    prompts = random_prompts(4, VOCAB, 4, 20, seed=5)
    plain = _tokens(_llm(model).generate(prompt_token_ids=prompts, sampling_params=GREEDY))
    # Stop at a token in the middle of each reference; max_tokens not a multiple of k + 1.
    params = [
        SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, stop_token_ids=[ref[13]])
        for ref in plain[:2]
    ] + [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (7, 11)]
    want = _tokens(_llm(model).generate(prompt_token_ids=prompts, sampling_params=params))
    assert [len(w) for w in want[2:]] == [7, 11]
    llm = _oracle_llm(model, prompts, plain, corrupt_every=0)  # every draft right
    got = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    assert _tokens(got) == want
    assert [o.outputs[0].finish_reason for o in got] == ["stop", "stop", "length", "length"]
    assert all_blocks_free(llm)


def test_preemption_and_prefix_hits_match_plain(model):
    shared = random_prompts(1, VOCAB, 40, 41, seed=6)[0]
    prompts = [shared + p for p in random_prompts(4, VOCAB, 3, 9, seed=7)]
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    # 20 blocks of 8 tokens cannot hold four ~80-token sequences: preemption by recompute.
    kwargs = dict(block_size=8, num_kv_blocks=20)
    plain = _tokens(
        _llm(model, **kwargs).generate(prompt_token_ids=prompts, sampling_params=params)
    )
    llm = _oracle_llm(model, prompts, plain, corrupt_every=3, **kwargs)
    assert _tokens(llm.generate(prompt_token_ids=prompts, sampling_params=params)) == plain
    core = llm.engine.core
    assert core.scheduler.stats.num_preemptions > 0
    assert core.get_stats().prefix_cache_hit_tokens > 0
    assert all_blocks_free(llm)
    # Again, one at a time: the cached prefix (hashed over accepted tokens only) is reused.
    again = [llm.generate(prompt_token_ids=[p], sampling_params=params)[0] for p in prompts[:2]]
    assert _tokens(again) == plain[:2]
    assert all_blocks_free(llm)


def test_async_scheduling_overlaps_above_the_speculation_bound(model):
    """Async scheduling with speculation: while more sequences run than disable_by_batch_size,
    steps overlap and reserve no drafts; once few run, steps draft and verify synchronously.
    Greedy tokens equal plain decoding throughout, every block comes back."""
    prompts = _repetitive_prompts(6, seed=7)
    lengths = [6, 8, 10, 30, 36, 40]  # most finish early: the batch drops below the bound
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths]
    plain = _tokens(_llm(model).generate(prompt_token_ids=prompts, sampling_params=params))
    draft = {"method": "draft_model", "model": str(model), "num_speculative_tokens": 3}
    for spec in (NGRAM, draft):  # the draft model catches up on the overlapped steps' tokens
        llm = _llm(model, {**spec, "disable_by_batch_size": 3}, async_scheduling=True)
        assert _tokens(llm.generate(prompt_token_ids=prompts, sampling_params=params)) == plain
        stepper = llm.engine.core.async_stepper
        assert stepper is not None and stepper.num_overlapped_steps > 0
        assert _stats(llm).num_drafts > 0  # and the last three speculated
        assert all_blocks_free(llm)


def test_stop_strings_inside_a_run():
    probe = LLM("demo", device="cpu", dtype="float32")
    prompts = ["The quick brown fox", "Once upon a time", "Hello world"]
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    outs = probe.generate(prompts, greedy)
    stops = [o.outputs[0].text[len(o.outputs[0].text) // 2 :][:3] for o in outs]
    params = [
        SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, stop=[s], logprobs=2)
        for s in stops
    ]
    want = probe.generate(prompts, params)
    llm = LLM("demo", device="cpu", dtype="float32", speculative_config=NGRAM)
    refs = [o.prompt_token_ids + o.outputs[0].token_ids for o in outs]
    _runner(llm).spec_decoder.proposer = OracleProposer(refs, 0, llm.engine.vocab_size)
    got = llm.generate(prompts, params)
    for g, w, stop in zip(got, want, stops, strict=True):
        g0, w0 = g.outputs[0], w.outputs[0]
        assert (g0.text, g0.token_ids, g0.stop_reason) == (w0.text, w0.token_ids, stop)
        assert len(g0.logprobs) == len(g0.token_ids)
        for a, b in zip(g0.logprobs, w0.logprobs, strict=True):
            assert a.keys() == b.keys()
            assert all(a[t] == pytest.approx(b[t], abs=1e-4) for t in a)
    assert _stats(llm).num_accepted_tokens > 0
    assert all_blocks_free(llm)


def test_no_drafts_for_n_beam_or_high_batch(model):
    prompts = _repetitive_prompts(3, seed=8)
    llm = _llm(model, NGRAM)
    params = [
        SamplingParams(n=2, temperature=0.8, seed=1, max_tokens=8, ignore_eos=True),
        SamplingParams(beam_width=2, temperature=0.0, max_tokens=6, ignore_eos=True),
    ]
    llm.generate(prompt_token_ids=prompts[:2], sampling_params=params)
    assert _stats(llm).num_draft_tokens == 0
    backoff = _llm(model, {**NGRAM, "disable_by_batch_size": 2})
    short = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    backoff.generate(prompt_token_ids=prompts, sampling_params=short)  # 3 running: off
    first = _stats(backoff).num_draft_tokens
    backoff.generate(prompt_token_ids=prompts[:2], sampling_params=short)  # 2: on
    assert first == 0 and _stats(backoff).num_draft_tokens > 0
    assert all_blocks_free(llm) and all_blocks_free(backoff)


def _chi2_two_sample(a: np.ndarray, b: np.ndarray) -> tuple[float, int]:
    keep = (a + b) > 0
    a, b = a[keep], b[keep]
    total = a + b
    ea, eb = total * a.sum() / total.sum(), total * b.sum() / total.sum()
    return float(((a - ea) ** 2 / ea).sum() + ((b - eb) ** 2 / eb).sum()), int(keep.sum()) - 1


@pytest.mark.slow  # the fast, stronger check: test_spec_decode_units.py's chi-square
def test_sampled_tokens_follow_the_plain_distribution(tmp_path):
    """Temperature 1 with top-p 0.9 on a 12-token vocabulary: the second and third output
    tokens (the verified ones) of 400 requests with drafts, against 400 without:
    a two-sample chi-square test at p = 0.001 on each position."""
    path, _ = make_hf_model(tmp_path, vocab_size=12, seed=4)
    prompt = [3, 5, 7, 9]
    num = 400
    params = [SamplingParams(temperature=1.0, top_p=0.9, max_tokens=4, ignore_eos=True)] * num
    spec = {"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 4096}
    counts = []
    for config in (None, spec):
        llm = _llm(path, config, max_num_seqs=400, num_kv_blocks=500, block_size=8)
        if config is not None:  # drafts: the likeliest token of each position, often wrong
            likeliest = [int(c.argmax()) for c in counts[0]]
            _runner(llm).spec_decoder.proposer = _ConstantProposer(likeliest)
        outs = llm.generate(prompt_token_ids=[prompt] * num, sampling_params=params)
        tokens = np.array(_tokens(outs))
        counts.append([np.bincount(tokens[:, j], minlength=12) for j in (1, 2)])
        assert all_blocks_free(llm)
    assert _stats(llm).num_accepted_tokens > 40
    # Critical chi-square values at p = 0.001 for 1..11 degrees of freedom.
    critical = [10.8, 13.8, 16.3, 18.5, 20.5, 22.5, 24.3, 26.1, 27.9, 29.6, 31.3]
    for j in range(2):
        stat, dof = _chi2_two_sample(counts[0][j], counts[1][j])
        assert stat < critical[dof - 1], (j, counts[0][j], counts[1][j])


class _ConstantProposer(OracleProposer):
    def __init__(self, drafts: list[int]) -> None:
        super().__init__([])
        self.drafts = drafts

    def propose(self, requests):
        return [self.drafts[: r.max_drafts] for r in requests]


def test_draft_model_greedy_matches_plain(model, tmp_path):
    """The target as its own draft (every draft right) and another random model of the same
    vocabulary (most drafts wrong), through preemption in a small cache."""
    other, _ = make_hf_model(tmp_path / "draft", vocab_size=VOCAB, num_layers=1, seed=9)
    prompts = random_prompts(4, VOCAB, 20, 40, seed=11)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    kwargs = dict(block_size=8, num_kv_blocks=22)
    plain = _tokens(
        _llm(model, **kwargs).generate(prompt_token_ids=prompts, sampling_params=params)
    )
    for draft, min_rate in ((model, 0.9), (other, 0.0)):
        spec = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3}
        llm = _llm(model, spec, **kwargs)
        assert _tokens(llm.generate(prompt_token_ids=prompts, sampling_params=params)) == plain
        stats = _stats(llm)
        assert stats.num_draft_tokens > 0 and stats.acceptance_rate >= min_rate
        assert all_blocks_free(llm)
    assert llm.engine.core.scheduler.stats.num_preemptions > 0


def test_draft_model_needs_the_same_vocabulary(model, tmp_path):
    other, _ = make_hf_model(tmp_path / "draft", vocab_size=128, num_layers=1)
    spec = {"method": "draft_model", "model": str(other), "num_speculative_tokens": 2}
    with pytest.raises(ValueError, match="vocabulary"):
        _llm(model, spec)


# Greedy requests whose logits processors move the argmax: the target verifies the argmax
# after them (min_tokens mask, logit bias, penalties with the drafts counted as output).
PROCESSED = {
    "plain": {},
    "repetition": {"repetition_penalty": 1.3},
    "presence_frequency": {"presence_penalty": 0.5, "frequency_penalty": 0.5},
    "logit_bias": {"logit_bias": {5: 2.0, 17: 3.0}},
    "min_tokens": {"min_tokens": 24},  # its stop ids: every token of the plain output
}
DEMO_PROMPTS = ["The quick brown fox", "Once upon a time", "Hello world", "A block table maps"]


@pytest.fixture(scope="module")
def demo_engines():
    """The demo model plain, and with itself as its draft model (k = 4)."""
    spec = {"method": "draft_model", "model": "demo", "num_speculative_tokens": 4}
    kwargs = dict(device="cpu", dtype="float32", num_kv_blocks=64)
    return LLM("demo", **kwargs), LLM("demo", speculative_config=spec, **kwargs)


@pytest.mark.parametrize("case", list(PROCESSED))
def test_identical_draft_model_is_accepted_greedy_on_the_demo_model(demo_engines, case):
    """The demo model as its own draft, greedy: every draft is the target's next token, so
    all are accepted (72 of 72 here; bound 90 %: a float32 near-tie between the draft's
    forward and the verify step's may flip one), whatever logits processors the request
    has: the draft takes its argmax after them too. Tokens equal plain decoding."""
    plain, llm = demo_engines
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, **PROCESSED[case])
    if case == "min_tokens":  # the mask holds back every token greedy decoding took
        taken = set(np.concatenate(_tokens(plain.generate(DEMO_PROMPTS, params))).tolist())
        params = SamplingParams(
            temperature=0.0, max_tokens=24, min_tokens=24, stop_token_ids=sorted(taken)
        )
    want = _tokens(plain.generate(DEMO_PROMPTS, params))
    before = _stats(llm)
    assert _tokens(llm.generate(DEMO_PROMPTS, params)) == want
    after = _stats(llm)
    num_drafted = after.num_draft_tokens - before.num_draft_tokens
    num_accepted = after.num_accepted_tokens - before.num_accepted_tokens
    assert num_drafted >= 40
    assert num_accepted >= 0.9 * num_drafted, (case, num_accepted, num_drafted)
    assert all_blocks_free(llm)
