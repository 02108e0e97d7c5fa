"""Sampler, penalties, sampling metadata and SamplingParams validation (CPU, exact where possible)."""

from __future__ import annotations

import math

import pytest
import torch

from pydaemon.sampling import Sampler, SamplingMetadata, make_generator
from pydaemon.sampling.penalties import (
    apply_presence_frequency_penalties,
    apply_repetition_penalty,
)
from pydaemon.sampling.sampler import apply_min_p, apply_top_k_top_p
from pydaemon.sampling_params import SamplingParams

NEG_INF = float("-inf")


def make_metadata(
    params: list[SamplingParams],
    prompts: list[list[int]] | None = None,
    outputs: list[list[int]] | None = None,
    generators: list[torch.Generator | None] | None = None,
    stop_ids: list[set[int]] | None = None,
) -> SamplingMetadata:
    num = len(params)
    return SamplingMetadata.build(
        params,
        prompts if prompts is not None else [[] for _ in range(num)],
        outputs if outputs is not None else [[] for _ in range(num)],
        generators if generators is not None else [None] * num,
        "cpu",
        stop_ids_for_min_tokens=stop_ids,
    )


def kept(logits: torch.Tensor) -> list[set[int]]:
    """Token ids left unmasked per row."""
    return [set(torch.nonzero(row > NEG_INF).flatten().tolist()) for row in logits]


def log_probs(*probs: float) -> list[float]:
    return [math.log(p) for p in probs]


# ---------------------------------------------------------------- SamplingParams validation


@pytest.mark.parametrize(
    "field, value",
    [
        ("n", 0),
        ("n", 1000),
        ("best_of", 0),
        ("temperature", -0.1),
        ("temperature", 101.0),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_k", -2),
        ("min_p", -0.1),
        ("min_p", 1.1),
        ("presence_penalty", 2.5),
        ("frequency_penalty", -2.5),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", 11.0),
        ("seed", -1),
        ("max_tokens", 0),
        ("min_tokens", -1),
        ("min_tokens", 17),  # > max_tokens (16)
        ("logprobs", -1),  # the upper bound is the engine's --max-logprobs
        ("logprob_token_ids", [1, 1]),
        ("stop", [""]),
        ("stop_token_ids", [-3]),
        ("beam_width", 0),
    ],
)
def test_sampling_params_bad_field_names_it(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_sampling_params_cross_field_rules() -> None:
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(beam_width=4, temperature=1.0)
    with pytest.raises(ValueError, match="n"):
        SamplingParams(beam_width=2, n=3, temperature=0.0)
    with pytest.raises(ValueError, match="best_of"):
        SamplingParams(n=1, best_of=3, temperature=0.0)
    assert SamplingParams(top_k=-1).top_k == 0
    assert SamplingParams(stop="x").stop == ["x"]
    assert SamplingParams(n=2).best_of == 2


# ---------------------------------------------------------------- metadata


def test_all_greedy_metadata_builds_no_tensors() -> None:
    meta = make_metadata([SamplingParams(temperature=0.0, top_k=5, top_p=0.5)] * 3)
    assert meta.all_greedy and not meta.all_random
    for name in (
        "temperature",
        "is_greedy",
        "top_k",
        "top_p",
        "min_p",
        "presence_penalty",
        "repetition_penalty",
        "prompt_token_ids",
        "output_token_ids",
        "min_tokens_rows",
    ):
        assert getattr(meta, name) is None, name
    assert meta.max_num_logprobs is None


def test_metadata_row_count_mismatch_is_an_error() -> None:
    with pytest.raises(ValueError, match="output_token_ids"):
        SamplingMetadata.build([SamplingParams()], [[1]], [], [None], "cpu")


def test_logits_shape_checked() -> None:
    meta = make_metadata([SamplingParams()] * 2)
    with pytest.raises(ValueError, match="num_seqs=2"):
        Sampler()(torch.zeros(3, 8), meta)
    with pytest.raises(ValueError, match="float32"):
        Sampler()(torch.zeros(2, 8, dtype=torch.float16), meta)


# ---------------------------------------------------------------- greedy


def test_greedy_is_argmax() -> None:
    torch.manual_seed(0)
    logits = torch.randn(7, 50)
    out = Sampler()(logits, make_metadata([SamplingParams(temperature=0.0)] * 7))
    assert out.sampled_token_ids == logits.argmax(dim=-1).tolist()
    expected = logits.log_softmax(-1).gather(1, logits.argmax(-1, keepdim=True)).flatten()
    assert out.chosen_logprobs == pytest.approx(expected.tolist(), abs=1e-6)
    assert out.logprobs == [None] * 7


def test_greedy_rows_in_a_mixed_batch_stay_argmax() -> None:
    torch.manual_seed(1)
    logits = torch.randn(6, 40)
    params = [SamplingParams(temperature=0.0 if i % 2 else 1.5, top_k=3) for i in range(6)]
    out = Sampler()(logits, make_metadata(params))
    for i in range(1, 6, 2):
        assert out.sampled_token_ids[i] == int(logits[i].argmax())
    for i in range(0, 6, 2):
        assert out.sampled_token_ids[i] in set(logits[i].topk(3).indices.tolist())


# ---------------------------------------------------------------- masks


def test_top_k_mask_exact() -> None:
    logits = torch.tensor([[1.0, 5.0, 3.0, 4.0, 2.0], [0.5, 0.1, 0.2, 0.3, 0.4]])
    top_k = torch.tensor([2, 0])  # row 1: disabled
    out = apply_top_k_top_p(logits, top_k, 2, None)
    assert kept(out) == [{1, 3}, {0, 1, 2, 3, 4}]
    assert out[0, 1] == 5.0 and out[0, 3] == 4.0  # survivors unchanged


def test_top_p_mask_exact() -> None:
    logits = torch.tensor([log_probs(0.5, 0.3, 0.15, 0.05)] * 4)
    top_p = torch.tensor([0.7, 0.9, 0.4, 1.0])
    out = apply_top_k_top_p(logits, None, 0, top_p)
    assert kept(out) == [{0, 1}, {0, 1, 2}, {0}, {0, 1, 2, 3}]


def test_top_p_applies_after_top_k() -> None:
    # After top-k=2 the distribution is [0.625, 0.375]: p=0.6 keeps only token 0 (0.625 >= 0.6);
    # without top-k, p=0.6 would keep {0, 1} (0.5 < 0.6).
    logits = torch.tensor([log_probs(0.5, 0.3, 0.15, 0.05)] * 2)
    out = apply_top_k_top_p(logits, torch.tensor([2, 0]), 2, torch.tensor([0.6, 0.6]))
    assert kept(out) == [{0}, {0, 1}]


def test_min_p_mask_exact() -> None:
    logits = torch.tensor([log_probs(0.5, 0.3, 0.15, 0.05)] * 3)
    out = apply_min_p(logits, torch.tensor([0.2, 0.7, 0.0]))
    assert kept(out) == [{0, 1, 2}, {0}, {0, 1, 2, 3}]


@pytest.mark.parametrize(
    "params, allowed",
    [
        (SamplingParams(temperature=1.0, top_k=2), {0, 1}),
        (SamplingParams(temperature=1.0, top_p=0.7), {0, 1}),
        (SamplingParams(temperature=1.0, min_p=0.2), {0, 1, 2}),
        (SamplingParams(temperature=3.0, top_k=3, top_p=0.99), {0, 1, 2}),
    ],
)
def test_sampler_only_draws_unmasked_tokens(params: SamplingParams, allowed: set[int]) -> None:
    torch.manual_seed(2)
    num = 2000
    logits = torch.tensor([log_probs(0.5, 0.3, 0.15, 0.05)] * num)
    out = Sampler()(logits, make_metadata([params] * num))
    assert set(out.sampled_token_ids) == allowed


# ---------------------------------------------------------------- penalties


def test_repetition_penalty_exact() -> None:
    logits = torch.tensor([[2.0, -2.0, 1.0, -1.0, 0.5], [2.0, -2.0, 1.0, -1.0, 0.5]])
    prompt = torch.tensor([[0, 1, -1], [4, -1, -1]])
    output = torch.tensor([[2, 2], [-1, -1]])
    out = apply_repetition_penalty(logits, prompt, output, torch.tensor([2.0, 1.0]))
    assert out.tolist() == [[1.0, -4.0, 0.5, -1.0, 0.5], [2.0, -2.0, 1.0, -1.0, 0.5]]


def test_presence_frequency_penalties_exact() -> None:
    logits = torch.zeros(2, 4)
    output = torch.tensor([[1, 1, 1, 3], [2, -1, -1, -1]])
    out = apply_presence_frequency_penalties(
        logits, output, torch.tensor([0.5, -1.0]), torch.tensor([0.25, 0.0])
    )
    assert out.tolist() == [[0.0, -1.25, 0.0, -0.75], [0.0, 0.0, 1.0, 0.0]]


def test_penalties_through_the_sampler_change_greedy_choice() -> None:
    logits = torch.tensor([[3.0, 2.5, -1.0, 0.0]] * 3)
    params = [
        SamplingParams(temperature=0.0, repetition_penalty=1.5),  # 3/1.5=2 < 2.5 -> token 1
        SamplingParams(temperature=0.0, frequency_penalty=0.3),  # 3-0.3*2=2.4 < 2.5 -> 1
        SamplingParams(temperature=0.0, presence_penalty=0.4),  # 3-0.4=2.6 > 2.5 -> 0
    ]
    meta = make_metadata(params, prompts=[[0], [3], [3]], outputs=[[], [0, 0], [0, 0]])
    out = Sampler()(logits, meta)
    assert out.sampled_token_ids == [1, 1, 0]
    # logprobs stay those of the raw logits
    raw = logits.log_softmax(-1)
    assert out.chosen_logprobs == pytest.approx(
        [raw[0, 1].item(), raw[1, 1].item(), raw[2, 0].item()], abs=1e-6
    )


def test_repetition_penalty_counts_output_tokens_too() -> None:
    logits = torch.tensor([[3.0, 2.5]])
    meta = make_metadata([SamplingParams(temperature=0.0, repetition_penalty=1.5)], [[]], [[0]])
    assert Sampler()(logits, meta).sampled_token_ids == [1]


# ---------------------------------------------------------------- min_tokens


def test_min_tokens_blocks_stop_ids_until_reached() -> None:
    logits = torch.tensor([[0.0, 9.0, 8.0, 1.0]] * 3)
    params = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[2])
    meta = make_metadata([params] * 3, outputs=[[], [3], [3, 3]], stop_ids=[{1, 2}, {1, 2}, {1, 2}])
    assert Sampler()(logits, meta).sampled_token_ids == [3, 3, 1]
    # without stop_ids_for_min_tokens only the params' stop_token_ids are blocked
    meta = make_metadata([SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[1])])
    assert Sampler()(logits[:1], meta).sampled_token_ids == [2]
    with pytest.raises(ValueError, match="outside the vocabulary"):
        Sampler()(logits, make_metadata([params] * 3, stop_ids=[{7}, set(), set()]))


# ---------------------------------------------------------------- random sampling


@pytest.mark.parametrize("temperature", [1.0, 0.5, 2.0])
def test_temperature_sampling_frequencies(temperature: float) -> None:
    torch.manual_seed(3)
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    num = 20000
    logits = probs.log().repeat(num, 1)
    out = Sampler()(logits, make_metadata([SamplingParams(temperature=temperature)] * num))
    counts = torch.bincount(torch.tensor(out.sampled_token_ids), minlength=4).double() / num
    expected = probs.double() ** (1.0 / temperature)
    expected /= expected.sum()
    assert torch.allclose(counts, expected, atol=0.015), (counts, expected)


def test_seeded_rows_reproducible_whatever_the_batch() -> None:
    torch.manual_seed(4)
    vocab = 64
    row_logits = torch.randn(vocab)
    seeded = SamplingParams(temperature=1.0, seed=1234, top_p=0.95)

    def run(batch_size: int, position: int, others: SamplingParams, steps: int = 5) -> list[int]:
        generator = make_generator(seeded.seed, 0, "cpu")
        other_gens = [make_generator(others.seed, i + 1, "cpu") for i in range(batch_size)]
        tokens = []
        for _ in range(steps):
            logits = torch.randn(batch_size, vocab)
            logits[position] = row_logits
            params = [others] * batch_size
            params[position] = seeded
            gens = list(other_gens)
            gens[position] = generator
            out = Sampler()(logits, make_metadata(params, generators=gens))
            tokens.append(out.sampled_token_ids[position])
        return tokens

    alone = run(1, 0, seeded)
    assert len(set(alone)) > 1  # the stream advances step to step
    assert run(5, 3, SamplingParams(temperature=0.7)) == alone
    assert run(4, 0, SamplingParams(temperature=0.0)) == alone
    assert run(3, 2, SamplingParams(temperature=1.0, seed=99, top_k=5)) == alone


def test_make_generator_streams() -> None:
    assert make_generator(None, 0, "cpu") is None

    def draws(seed: int, index: int) -> list[float]:
        return torch.rand(4, generator=make_generator(seed, index, "cpu")).tolist()

    assert draws(7, 0) == draws(7, 0)
    assert draws(7, 0) != draws(7, 1)
    assert draws(7, 0) != draws(8, 0)
    with pytest.raises(ValueError, match="seq_index"):
        make_generator(1, -1, "cpu")


# ---------------------------------------------------------------- logprobs


def test_logprobs_are_raw_top_k_plus_chosen() -> None:
    torch.manual_seed(5)
    logits = torch.randn(3, 30)
    params = [
        SamplingParams(temperature=0.0, logprobs=3, repetition_penalty=5.0),
        SamplingParams(temperature=2.0, top_k=20, logprobs=0),
        SamplingParams(temperature=2.0, logprobs=None),
    ]
    meta = make_metadata(params, prompts=[list(range(30)), [], []])
    out = Sampler()(logits, meta)
    raw = logits.log_softmax(-1)
    # row 0: top-3 raw logprobs, plus the chosen token if it is not among them
    top3 = raw[0].topk(3)
    expected = dict(zip(top3.indices.tolist(), top3.values.tolist(), strict=True))
    chosen = out.sampled_token_ids[0]
    expected[chosen] = raw[0, chosen].item()
    assert out.logprobs[0] == pytest.approx(expected, abs=1e-6)
    # row 1: only the chosen token
    assert set(out.logprobs[1]) == {out.sampled_token_ids[1]}
    assert out.logprobs[1][out.sampled_token_ids[1]] == pytest.approx(
        raw[1, out.sampled_token_ids[1]].item(), abs=1e-6
    )
    assert out.logprobs[2] is None
    for i in range(3):
        assert out.chosen_logprobs[i] == pytest.approx(
            raw[i, out.sampled_token_ids[i]].item(), abs=1e-6
        )


# ---------------------------------------------------------------- logit_bias (issue 46)


def test_logit_bias_params_are_checked_and_clamped() -> None:
    p = SamplingParams(logit_bias={5: 250.0, 6: -1e9, 7: 0.5})
    assert p.logit_bias == {5: 100.0, 6: -100.0, 7: 0.5}  # vLLM's clamp to [-100, 100]
    for bad in (
        {-1: 1.0},
        {"5": 1.0},
        {5: float("nan")},
        {5: "x"},
        dict.fromkeys(range(1025), 1.0),
    ):
        with pytest.raises(ValueError, match="logit_bias"):
            SamplingParams(logit_bias=bad)
    assert SamplingParams(logit_bias={}).logit_bias is None


def test_logit_bias_greedy_against_a_float64_reference() -> None:
    torch.manual_seed(11)
    vocab = 64
    logits = torch.randn(8, vocab) * 3
    biases = [{int(t): float(v) for t, v in zip(torch.randint(vocab, (4,)),
                                                 torch.randn(4) * 5, strict=True)}
              for _ in range(8)]  # fmt: skip
    biases[0] = {int(logits[0].argmin()): 100.0}  # the least likely token wins
    biases[1] = {int(logits[1].argmax()): -100.0}  # the most likely one loses
    params = [SamplingParams(temperature=0.0, logit_bias=b) for b in biases]
    out = Sampler()(logits, make_metadata(params))
    reference = logits.double().clone()
    for row, bias in enumerate(biases):
        for token_id, value in bias.items():
            reference[row, token_id] += value
    assert out.sampled_token_ids == reference.argmax(-1).tolist()
    assert out.sampled_token_ids[0] == int(logits[0].argmin())
    assert out.sampled_token_ids[1] != int(logits[1].argmax())
    # logprobs stay those of the raw logits
    chosen = logits.log_softmax(-1)[range(8), out.sampled_token_ids]
    assert torch.allclose(
        torch.tensor(out.chosen_logprobs, dtype=torch.float64), chosen.double(), atol=1e-6
    )


def test_logit_bias_seeded_sampling_against_a_float64_reference() -> None:
    """The exponential race on softmax((logits + bias) / T), with the row's own stream."""
    torch.manual_seed(12)
    vocab, temperature = 48, 0.8
    logits = torch.randn(6, vocab)
    tokens, refs = [], []
    for row in range(6):
        bias = {row: 3.0, row + 10: -2.0, 40: 1.5}
        params = SamplingParams(temperature=temperature, seed=100 + row, logit_bias=bias)
        gen = make_generator(params.seed, 0, "cpu")
        out = Sampler()(logits[row : row + 1], make_metadata([params], generators=[gen]))
        tokens.append(out.sampled_token_ids[0])
        biased = logits[row].double().clone()
        for token_id, value in bias.items():
            biased[token_id] += value
        probs = (biased / temperature).softmax(-1)
        noise = torch.empty(vocab).exponential_(generator=make_generator(params.seed, 0, "cpu"))
        refs.append(int((probs / noise.double()).argmax()))
    assert tokens == refs


def test_logit_bias_shifts_the_sampled_distribution() -> None:
    torch.manual_seed(13)
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    num = 20000
    bias = {3: math.log(10.0)}  # token 3 ten times likelier: 0.05 -> 0.5 before renormalising
    params = [SamplingParams(temperature=1.0, logit_bias=bias)] * num
    out = Sampler()(probs.log().repeat(num, 1), make_metadata(params))
    counts = torch.bincount(torch.tensor(out.sampled_token_ids), minlength=4).double() / num
    expected = torch.tensor([0.5, 0.3, 0.15, 0.5], dtype=torch.float64)
    assert torch.allclose(counts, expected / expected.sum(), atol=0.015), counts


def test_logit_bias_after_the_min_tokens_mask_and_before_penalties() -> None:
    logits = torch.zeros(1, 8)
    # min_tokens bars EOS (7) even with +100; the bias then the repetition penalty apply
    params = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[7], logit_bias={7: 100.0, 3: 4.0},
                            repetition_penalty=8.0)  # fmt: skip
    out = Sampler()(logits, make_metadata([params], prompts=[[3]], stop_ids=[{7}]))
    # token 3: (0 + 4) / 8 = 0.5 after the penalty, still above the others' 0
    assert out.sampled_token_ids == [3]
    params = SamplingParams(temperature=0.0, logit_bias={7: 100.0})
    assert Sampler()(logits, make_metadata([params])).sampled_token_ids == [7]
