"""BeamSearchState against transformers' generate(num_beams=...) on a tiny random Llama.

The driver below plays the engine: one token list per live beam, full recompute of the
logits with the HF model on every step, fork/free by the parent indices the state returns.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pydaemon.core.beam_search import BeamSearchState, length_normalized, top_k

transformers = pytest.importorskip("transformers")

VOCAB = 96
PROMPT = [1, 17, 33, 5, 60, 8]


def build_model() -> transformers.LlamaForCausalLM:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    model = transformers.LlamaForCausalLM(config).to(torch.float32).eval()
    # Sharper distributions than the default init, so beams really diverge and EOS can win.
    with torch.no_grad():
        model.lm_head.weight.mul_(4.0)
    return model


@pytest.fixture(scope="module")
def model() -> transformers.LlamaForCausalLM:
    return build_model()


def greedy_path(model: transformers.LlamaForCausalLM, steps: int = 4) -> list[list[int]]:
    """The top-3 tokens at each step of the model's greedy path: good EOS choices (the
    greedy token ends beams early and often, the runner-up ends a few of them)."""
    ids = list(PROMPT)
    tops = []
    with torch.no_grad():
        for _ in range(steps):
            top = model(torch.tensor([ids])).logits[0, -1].topk(3).indices.tolist()
            tops.append(top)
            ids.append(top[0])
    return tops


def run_state(model, state: BeamSearchState) -> tuple[list[tuple[list[int], float]], int]:
    """Returns the hypotheses and how many steps ran before the first one finished."""
    live = [list(PROMPT)]  # the engine's sequences, one per live beam
    num_steps = 0
    steps_before_first_finish = -1
    with torch.no_grad():
        while not state.is_done:
            # Full recompute of every live beam (no KV cache): independent of HF's cache path.
            # All live beams have the same length, so they go as one batch.
            logits = model(torch.tensor(live)).logits[:, -1]
            result = state.step(logits.float().log_softmax(dim=-1))
            live = [
                live[p] + [t] for p, t in zip(result.parent_indices, result.token_ids, strict=True)
            ]
            assert len(live) == state.beam_width
            num_steps += 1
            if result.num_finished and steps_before_first_finish < 0:
                steps_before_first_finish = num_steps
    assert num_steps <= state.max_new_tokens
    return [(h.token_ids, h.score) for h in state.finalize()], steps_before_first_finish


def run_hf(model, width, num_return, length_penalty, early_stopping, eos, max_new_tokens):
    out = model.generate(
        torch.tensor([PROMPT]),
        attention_mask=torch.ones(1, len(PROMPT), dtype=torch.long),
        num_beams=width,
        num_return_sequences=num_return,
        length_penalty=length_penalty,
        early_stopping=early_stopping,
        do_sample=False,
        max_new_tokens=max_new_tokens,
        eos_token_id=eos,
        pad_token_id=0,
        return_dict_in_generate=True,
        output_scores=True,
    )
    generated_len = (out.beam_indices >= 0).sum(dim=1).tolist()
    sequences = out.sequences[:, len(PROMPT) :].tolist()
    return [
        (seq[:n], score)
        for seq, n, score in zip(
            sequences, generated_len, out.sequences_scores.tolist(), strict=True
        )
    ]


CONFIGS = [
    # (width, num_return, length_penalty, early_stopping, eos kind, max_new_tokens)
    (4, 2, 1.0, False, "runner_up", 8),
    (3, 3, 0.5, True, "runner_up", 8),
    (4, 4, 1.0, False, "none", 6),
    (2, 1, 2.0, "never", "greedy", 7),
    (5, 3, -0.5, False, "two", 10),
    (3, 2, 1.0, True, "greedy", 8),
]


@pytest.mark.parametrize("width, num_return, lp, early, eos_kind, max_new", CONFIGS)
def test_beam_search_matches_transformers(
    model, width, num_return, lp, early, eos_kind, max_new
) -> None:
    tops = greedy_path(model)
    eos = {
        "runner_up": [tops[0][1]],
        "greedy": [tops[1][0]],
        "none": [VOCAB - 1],
        "two": [tops[0][2], tops[2][1]],
    }[eos_kind]
    expected = run_hf(model, width, num_return, lp, early, eos, max_new)
    state = BeamSearchState(width, num_return, lp, early, eos, len(PROMPT), max_new)
    got, steps_before_first_finish = run_state(model, state)
    assert [tokens for tokens, _ in got] == [tokens for tokens, _ in expected]
    assert [score for _, score in got] == pytest.approx([s for _, s in expected], abs=1e-4)
    if eos_kind != "none":  # a hypothesis finished by EOS before max_new_tokens
        assert 0 < steps_before_first_finish < max_new


def test_engine_protocol_and_errors() -> None:
    state = BeamSearchState(2, 1, 1.0, False, [0], prompt_len=3, max_new_tokens=2)
    with pytest.raises(ValueError, match=r"\[1, vocab\]"):
        state.step(torch.zeros(2, 8))
    # first step: one live row; token 3 best, EOS (0) second, token 5 third
    logprobs = torch.full((1, 8), -10.0)
    logprobs[0, 3], logprobs[0, 0], logprobs[0, 5] = -0.1, -0.5, -1.0
    first = state.step(logprobs.log_softmax(-1))
    assert first.parent_indices == [0, 0] and first.token_ids == [3, 5]
    assert first.num_finished == 1 and not first.is_done  # [0] finished, two live beams
    second = torch.full((2, 8), -10.0)
    second[0, 4], second[1, 6] = -0.2, -0.3
    result = state.step(second.log_softmax(-1))
    assert result.is_done  # max_new_tokens reached
    with pytest.raises(RuntimeError, match="done"):
        state.step(second)
    best = state.finalize()
    assert len(best) == 1 and best[0].token_ids == [3, 4]
    for bad in (
        dict(beam_width=0),
        dict(num_return=3),
        dict(early_stopping="sometimes"),
        dict(max_new_tokens=0),
    ):
        kwargs = dict(
            beam_width=2,
            num_return=1,
            length_penalty=1.0,
            early_stopping=False,
            eos_token_ids=[0],
            prompt_len=3,
            max_new_tokens=4,
        )
        kwargs.update(bad)
        with pytest.raises(ValueError, match=next(iter(bad))):
            BeamSearchState(**kwargs)


def test_min_new_tokens_blocks_eos() -> None:
    state = BeamSearchState(2, 2, 1.0, False, [0], 1, 3, min_new_tokens=2)
    logprobs = torch.tensor([[-0.1, -2.0, -3.0, -4.0]])
    assert 0 not in state.step(logprobs).token_ids and state.num_generated == 1
    assert state.is_finished.sum() == 0


@pytest.mark.parametrize("lp", [200.0, 1e10, -1e10, -200.0])
def test_extreme_length_penalty_never_overflows(lp) -> None:
    """`length ** length_penalty` overflowed a float (OverflowError killed the engine); the
    score is now taken in log space and saturates instead."""
    torch.manual_seed(0)
    max_new = 64
    state = BeamSearchState(3, 2, lp, "never", [0], prompt_len=4, max_new_tokens=max_new)
    while not state.is_done:
        state.step(torch.randn(state.num_live_beams, 16).log_softmax(-1))
    best = state.finalize()
    assert len(best) == 2
    assert not any(torch.isnan(torch.tensor([h.score for h in best])))


def test_length_normalized_is_transformers_expression_when_finite() -> None:
    """numpy float32, bit for bit what transformers' torch expression gives."""
    values = torch.tensor([-3.5, -0.25, -12.0])
    array = values.numpy()
    for length, lp in ((7, 1.0), (64, 2.0), (3, -0.5), (100, 10.0), (13, 0.7)):
        got = length_normalized(array, length, lp)
        assert got.dtype == np.float32
        assert np.array_equal(got, (values / (length**lp)).numpy())
    # far beyond float range: saturates (to -0 or -inf) in log space, no OverflowError
    assert np.abs(length_normalized(array, 64, 200.0)).max() < 1e-30
    assert np.isinf(length_normalized(array, 64, -200.0)).all()


def test_top_k_is_the_stable_order_of_the_k_largest() -> None:
    rng = np.random.default_rng(0)
    for n, k in ((10, 3), (1000, 16), (8, 8), (5, 7)):
        values = rng.integers(-4, 4, n).astype(np.float32)  # many ties
        values[rng.integers(0, n)] = -np.inf
        expected = np.argsort(-values, kind="stable")[:k]
        assert top_k(values, k).tolist() == expected.tolist()


@pytest.mark.parametrize("lp", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_length_penalty_rejected(lp) -> None:
    with pytest.raises(ValueError, match="length_penalty"):
        BeamSearchState(2, 1, lp, False, [0], prompt_len=3, max_new_tokens=4)
