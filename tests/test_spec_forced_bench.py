"""bench/spec_forced.py, the oracle benchmark's forced acceptance: drafts k tokens every step
(the reference's next tokens, padded with the last token past its end) and keeps them all."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.spec_forced import AcceptAllRejectionSampler, ForcedOracleProposer  # noqa: E402
from pydaemon import SamplingParams  # noqa: E402
from pydaemon.sampling.sampling_metadata import SamplingMetadata  # noqa: E402
from pydaemon.worker.spec_decode.proposer import DraftRequest  # noqa: E402
from pydaemon.worker.spec_decode.rejection_sampler import RejectionSampler  # noqa: E402


def _request(seq_id: int, tokens: list[int], k: int) -> DraftRequest:
    return DraftRequest(seq_id, np.asarray(tokens, dtype=np.int32), k)


def test_forced_oracle_drafts_k_tokens_every_step():
    proposer = ForcedOracleProposer([[1, 2], [3, 4]], [[10, 11, 12], [20, 21, 22]], max_drafts=2)
    # On its reference, off it (the position decides), and past its end (last token repeated).
    assert proposer.propose([_request(7, [3, 4], 5), _request(8, [1, 2, 10], 5)]) == [
        [20, 21],
        [11, 12],
    ]
    assert proposer.propose([_request(7, [3, 4, 99, 98], 5)]) == [[22, 98]]
    assert proposer.propose([_request(8, [1, 2, 10, 11, 12, 13], 1)]) == [[13]]  # 1 slot
    proposer.forget([7])
    with pytest.raises(ValueError, match="sequence 7 starts with none"):
        proposer.propose([_request(7, [5, 6], 2)])


def test_accept_all_keeps_every_draft_after_the_real_verification():
    logits = torch.zeros(5, 8)
    logits[:, 3] = 5.0  # the argmax is 3 everywhere: greedy verification rejects draft 6
    drafts = torch.tensor([6, 3, -1, 6, -1])  # sequence 0: drafts 6, 3; sequence 1: draft 6
    greedy = SamplingParams(temperature=0.0)
    metadata = SamplingMetadata.build(
        params=[greedy] * 5,
        prompt_token_ids=[[]] * 5,
        output_token_ids=[[]] * 5,
        generators=[None] * 5,
        device="cpu",
    )
    real = RejectionSampler().verify(logits, drafts, metadata)
    forced = AcceptAllRejectionSampler().verify(logits, drafts, metadata)
    assert real[:, 1].tolist() == [0, 1, 0, 0, 0]
    assert forced[:, 1].tolist() == [1, 1, 0, 1, 0]
    runs = RejectionSampler.accepted_runs(forced.tolist(), [2, 1], [None, None])
    assert [r.token_ids for r in runs] == [[6, 3, 3], [6, 3]]  # k drafts + the bonus token
