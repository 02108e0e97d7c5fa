"""The speculation governor (pydaemon/core/sched/spec_governor.py): per batch-size bucket it
keeps whichever of speculating and plain decoding emits more tokens per second, probing the
other kind now and then; on a fake clock, then in an engine whose clock makes one kind slow
(the output stays exactly that of plain decoding either way)."""

from __future__ import annotations

import pytest
from engine_utils import all_blocks_free, make_hf_model

from pydaemon import LLM, SamplingParams
from pydaemon.config.speculative import SpeculativeConfig
from pydaemon.core.sched.spec_governor import SpecGovernor


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _drive(gov: SpecGovernor, clock: Clock, steps: int, num_seqs: int, cost) -> list[bool]:
    """Runs ``steps`` pure decode steps of ``num_seqs`` sequences; ``cost(speculating)`` ->
    (seconds, tokens emitted). Returns each step's kind."""
    kinds = []
    for _ in range(steps):
        kind = gov.wants_drafts(num_seqs)
        seconds, tokens = cost(kind)
        clock.now += seconds
        gov.record(num_seqs, kind, tokens, counts=True)
        kinds.append(kind)
    return kinds


def _slow_spec(kind: bool) -> tuple[float, int]:  # drafts rarely accepted: 1.2 tokens in 3 ms
    return (3e-3, 10) if kind else (1e-3, 8)


def _fast_spec(kind: bool) -> tuple[float, int]:  # 2.5 tokens a sequence in 2 ms
    return (2e-3, 20) if kind else (1e-3, 8)


def test_speculation_that_is_slower_turns_off_and_is_probed_rarely():
    clock = Clock()
    gov = SpecGovernor(first_probe=16, probe_len=4, clock=clock)
    kinds = _drive(gov, clock, 2000, 8, _slow_spec)
    assert kinds[0] is True  # a bucket starts speculating
    assert not gov.wants_drafts(8) and not gov.wants_drafts(15)
    assert sum(kinds[100:]) / len(kinds[100:]) < 0.05  # probes cost few steps
    assert gov.describe()["8"]["speculating"] is False
    assert gov.drafts_off_at() == [8]
    bucket = gov.buckets[(8).bit_length()]
    bucket.probing, bucket.speculating = True, True  # probing drafts: still decided off
    assert gov.drafts_off_at() == [8]
    assert gov.wants_drafts(1) and gov.wants_drafts(16)  # other buckets: not measured yet


def test_speculation_that_pays_stays_on():
    clock = Clock()
    gov = SpecGovernor(first_probe=16, probe_len=4, clock=clock)
    kinds = _drive(gov, clock, 2000, 1, _fast_spec)
    assert gov.wants_drafts(1)
    assert sum(kinds[100:]) / len(kinds[100:]) > 0.95
    assert gov.buckets[1].probe_every > 16  # each confirming probe doubled the interval
    assert gov.drafts_off_at() == []
    assert gov.num_switches == 0


def test_a_change_of_text_is_followed_both_ways():
    clock = Clock()
    gov = SpecGovernor(first_probe=16, probe_len=4, max_probe_every=64, clock=clock)
    _drive(gov, clock, 500, 4, _fast_spec)
    assert gov.wants_drafts(4)
    _drive(gov, clock, 500, 4, _slow_spec)  # the drafts stopped being accepted
    assert not gov.wants_drafts(4)
    _drive(gov, clock, 500, 4, _fast_spec)  # and came back
    assert gov.wants_drafts(4)
    assert gov.num_switches == 2


def test_steps_that_do_not_count_and_pauses_give_no_sample():
    clock = Clock()
    gov = SpecGovernor(first_probe=2, probe_len=2, clock=clock)
    for _ in range(50):  # mixed steps (prefill tokens): never a sample
        clock.now += 1e-3
        gov.record(8, True, 8, counts=False)
    for _ in range(50):  # pure decode steps, each after a pause between bursts
        clock.now += 2.0
        gov.record(8, True, 8, counts=True)
    assert gov.buckets == {} and gov.wants_drafts(8)


def test_disabled_governor_always_drafts():
    clock = Clock()
    gov = SpecGovernor(enabled=False, first_probe=4, probe_len=2, clock=clock)
    assert all(_drive(gov, clock, 200, 8, _slow_spec))


def test_config_key():
    base = {"method": "ngram", "num_speculative_tokens": 2}
    assert SpeculativeConfig.from_dict(base).auto_disable is True
    assert SpeculativeConfig.from_dict({**base, "auto_disable": False}).auto_disable is False
    with pytest.raises(ValueError, match="auto_disable must be true or false"):
        SpeculativeConfig.from_dict({**base, "auto_disable": "no"})


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path, _ = make_hf_model(tmp_path_factory.mktemp("gov_llama"), vocab_size=256)
    return path


@pytest.mark.parametrize("spec_costs", [10.0, 0.1])
def test_engine_follows_the_measured_speed(model, spec_costs):
    """A clock on which a speculating step costs ``spec_costs`` times a plain one: the engine
    stops drafting (10x) or keeps drafting (0.1x), and the tokens equal plain decoding's."""
    prompts = [[5, 6, 7, 8, 9] * 3 + [5, 6], [11, 12, 13] * 4, [40, 41, 42, 43] * 3 + [40]]
    params = SamplingParams(temperature=0.0, max_tokens=120, ignore_eos=True)
    kw = dict(device="cpu", dtype="float32", num_kv_blocks=64)
    plain = LLM(str(model), **kw).generate(prompt_token_ids=prompts, sampling_params=params)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
    llm = LLM(str(model), speculative_config=spec, **kw)
    gov = llm.engine.core.scheduler.drafts.governor
    gov.first_probe, gov.probe_len = 8, 3
    clock = Clock()

    def tick() -> float:  # the step being recorded is of the kind the governor chose for it
        clock.now += 1e-3 * (spec_costs if gov.wants_drafts(3) else 1.0)
        return clock.now

    gov.clock = tick
    out = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    assert [o.outputs[0].token_ids for o in out] == [o.outputs[0].token_ids for o in plain]
    stats = llm.engine.core.get_stats().spec_decode
    assert gov.wants_drafts(3) is (spec_costs < 1)
    if spec_costs > 1:  # the drafts stopped after the first probe (and a few probes later)
        assert 0 < stats.num_drafts < 60
        assert stats.drafts_off_at == [2]  # 3 running sequences: the bucket of 2-3
    else:
        assert stats.num_drafts > 60 and stats.drafts_off_at == []
    assert all_blocks_free(llm)
