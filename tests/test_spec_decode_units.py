"""Speculative decoding's pieces: the n-gram lookup, the config, and the rejection sampler
(greedy acceptance, and a chi-square test that its output follows the target distribution)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pydaemon.config.speculative import SpeculativeConfig
from pydaemon.sampling.sampling_metadata import SamplingMetadata
from pydaemon.sampling_params import SamplingParams
from pydaemon.worker.spec_decode.ngram_proposer import NgramProposer, find_ngram_drafts
from pydaemon.worker.spec_decode.proposer import DraftRequest
from pydaemon.worker.spec_decode.rejection_sampler import RejectionSampler, target_probs


def _drafts(tokens, min_n=1, max_n=3, k=4):
    return find_ngram_drafts(np.asarray(tokens, dtype=np.int32), min_n, max_n, k).tolist()


def test_ngram_longest_then_most_recent_match():
    # Suffix [1, 2, 3] occurs at 0: the 3-gram wins over the later 1-gram [3] at 5.
    assert _drafts([1, 2, 3, 9, 8, 3, 7, 1, 2, 3]) == [9, 8, 3, 7]
    # Two earlier [5, 6]: the most recent one (at 3) is followed by 8.
    assert _drafts([5, 6, 7, 5, 6, 8, 5, 6], max_n=2, k=2) == [8, 5]
    assert _drafts([1, 2, 3, 4]) == []  # no earlier occurrence
    assert _drafts([4, 1, 2, 4], min_n=2) == []  # only a 1-gram matches
    assert _drafts([7, 7], k=3) == [7]  # at most what follows the match
    assert _drafts([1], k=3) == []


def test_ngram_proposer_caps_at_max_drafts():
    proposer = NgramProposer(4, 1, 3)
    tokens = np.array([1, 2, 3, 4, 5, 1, 2], dtype=np.int32)
    assert proposer.propose([DraftRequest(0, tokens, 2), DraftRequest(1, tokens[:3], 4)]) == [
        [3, 4],
        [],
    ]


@pytest.mark.parametrize(
    "values,message",
    [
        ({"method": "medusa", "num_speculative_tokens": 2}, "method"),
        ({"method": "eagle", "num_speculative_tokens": 2}, "model must name the EAGLE head"),
        ({"method": "eagle3", "model": "x", "num_speculative_tokens": 2}, "eagle3"),
        ({"method": "ngram"}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": 2, "k": 1}, "unknown key 'k'"),
        (
            {
                "method": "ngram",
                "num_speculative_tokens": 2,
                "prompt_lookup_min": 4,
                "prompt_lookup_max": 2,
            },
            "prompt_lookup_max",
        ),
        ({"method": "draft_model", "num_speculative_tokens": 2}, "model"),
        ([1, 2], "JSON object"),
    ],
)
def test_config_errors_name_the_key(values, message):
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig.from_dict(values)


def test_config_defaults():
    spec = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 3})
    assert (spec.prompt_lookup_min, spec.prompt_lookup_max, spec.disable_by_batch_size) == (
        1,
        5,
        32,
    )


def _metadata(params, generators=None):
    n = len(params)
    return SamplingMetadata.build(
        params=params,
        prompt_token_ids=[[]] * n,
        output_token_ids=[[]] * n,
        generators=generators or [None] * n,
        device="cpu",
    )


def test_greedy_accepts_while_equal():
    logits = torch.full((7, 6), -1.0)
    argmax = [3, 4, 5, 1, 2, 0, 4]
    logits[torch.arange(7), torch.tensor(argmax)] = 1.0
    # Sequence A: drafts [3, 4, 0] (the third is wrong) over rows 0..3; B: drafts [2, 0]
    # over rows 4..6, both right: then the bonus token 4.
    drafts = torch.tensor([3, 4, 0, -1, 2, 0, -1])
    params = [SamplingParams(temperature=0.0, logprobs=1)] * 7
    sampler = RejectionSampler()
    packed = sampler.verify(logits, drafts, _metadata(params))
    runs = sampler.accepted_runs(packed.tolist(), [3, 2], [1, None])
    assert runs[0].token_ids == [3, 4, 5]  # two accepted, then the argmax of row 2
    assert runs[1].token_ids == [2, 0, 4]  # all accepted, plus the bonus
    lp = logits.log_softmax(-1)
    assert runs[0].chosen_logprobs == pytest.approx(
        [float(lp[0, 3]), float(lp[1, 4]), float(lp[2, 5])]
    )
    assert set(runs[0].logprobs[2]) == {5}
    assert runs[1].logprobs == [None, None, None]


def _chi_square(counts: np.ndarray, probs: np.ndarray) -> float:
    expected = probs * counts.sum()
    keep = expected > 0
    assert counts[~keep].sum() == 0, "a token outside the target's support was emitted"
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


def test_rejection_sampling_keeps_the_target_distribution():
    """Rows with fixed target distributions (temperature 0.8, top-p 0.9); one draft each,
    the likeliest token or a less likely one. The first
    emitted token must follow row 0's distribution, and the second (given the draft was
    accepted) row 1's: chi-square at p = 0.001 over 6 tokens (critical value 20.5)."""
    torch.manual_seed(0)
    vocab, num_seqs = 6, 20000
    base = torch.tensor([[2.0, 1.5, 1.0, 0.5, 0.0, -1.0], [0.0, 1.0, 2.0, 0.3, -0.5, 1.2]])
    params = SamplingParams(temperature=0.8, top_p=0.9)
    for draft in (0, 2):
        logits = base.repeat(num_seqs, 1)  # rows 2s, 2s+1 of sequence s
        drafts = torch.tensor([draft, -1]).repeat(num_seqs)
        metadata = _metadata([params] * (2 * num_seqs))
        sampler = RejectionSampler()
        runs = sampler.accepted_runs(
            sampler.verify(logits, drafts, metadata).tolist(), [1] * num_seqs, [None] * num_seqs
        )
        first = np.bincount([r.token_ids[0] for r in runs], minlength=vocab)
        second = np.bincount(
            [r.token_ids[1] for r in runs if len(r.token_ids) == 2], minlength=vocab
        )
        target = _metadata([params] * 2)
        probs = target_probs(base, target).numpy().astype(np.float64)
        assert _chi_square(first, probs[0]) < 20.5
        assert _chi_square(second, probs[1]) < 20.5
        assert first[draft] > 0 and second.sum() == first[draft]


def test_seeded_rows_repeat():
    params = [SamplingParams(temperature=1.0, seed=7)] * 4
    logits = torch.randn(4, 32, generator=torch.Generator().manual_seed(1))
    drafts = torch.tensor([5, 6, 7, -1])
    results = []
    for _ in range(2):
        gen = torch.Generator().manual_seed(3)
        packed = RejectionSampler().verify(logits, drafts, _metadata(params, [gen] * 4))
        results.append(packed.tolist())
    assert results[0] == results[1]


def test_counters_reach_metrics_and_status():
    from pydaemon.core.stats import SpecDecodeStats
    from pydaemon.entrypoints.common.metrics import spec_decode_lines
    from pydaemon.entrypoints.grpc.admin import _plain_fields
    from pydaemon.proto.pagedd.v1 import generation_pb2 as pb

    warmup, now = SpecDecodeStats(), SpecDecodeStats()
    warmup.record(3, 1)
    for drafts, accepted in ((3, 1), (4, 3), (2, 0), (0, 0)):
        now.record(drafts, accepted)
    assert (now.num_drafts, now.num_draft_tokens, now.num_accepted_tokens) == (3, 9, 4)
    assert now.accepted_per_position == [2, 1, 1, 0]
    lines = spec_decode_lines(now, warmup)  # less the warm-up's
    assert "pagedd_spec_decode_draft_tokens_total 6" in lines
    assert "pagedd_spec_decode_accepted_tokens_total 3" in lines
    assert 'pagedd_spec_decode_accepted_tokens_per_pos_total{position="0"} 1' in lines
    status = pb.ServerStatus(
        spec_decode=pb.SpecDecodeStatus(
            num_drafts=3,
            num_draft_tokens=9,
            num_accepted_tokens=4,
            accepted_per_position=[2, 1],
            drafts_off_at=[8, 16],
        )
    )
    assert _plain_fields(status)["spec_decode"]["accepted_per_position"] == [2, 1]
    assert _plain_fields(status)["spec_decode"]["drafts_off_at"] == [8, 16]
    assert "spec_decode" not in _plain_fields(pb.ServerStatus())  # off: not printed


def test_verification_applies_the_logit_bias():
    """Issue 46: a draft is judged against the distribution the sampler uses, logit_bias
    included (greedy: the biased argmax)."""
    logits = torch.full((3, 6), -1.0)
    logits[:, 1] = 1.0  # unbiased argmax: 1 everywhere
    params = [SamplingParams(temperature=0.0, logit_bias={4: 5.0})] * 3
    sampler = RejectionSampler()
    packed = sampler.verify(logits, torch.tensor([4, 1, -1]), _metadata(params))
    [run] = sampler.accepted_runs(packed.tolist(), [2], [None])
    assert run.token_ids == [4, 4]  # draft 4 accepted, draft 1 rejected for the biased argmax
