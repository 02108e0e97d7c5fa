"""StopChecker: EOS, stop token ids, stop strings across tokens, streaming hold-back."""

from __future__ import annotations

import random

import pytest

from pydaemon.core.stop_checker import StopChecker, StopDecision
from pydaemon.sampling_params import SamplingParams

EOS = 1000


def run(checker: StopChecker, pieces: list[tuple[int, str]]) -> tuple[StopDecision, str, str]:
    """Feed (token_id, text piece) pairs like the engine does; return the final decision, the
    final text, and the concatenation of everything streamed (asserting no retraction)."""
    text = ""
    streamed = ""
    decision = StopDecision(None, None, 0)
    for num_output_tokens, (token_id, piece) in enumerate(pieces, start=1):
        text += piece
        decision = checker.check(token_id, num_output_tokens, text, len(piece))
        text = text[: decision.text_len]
        safe = checker.safe_stream_len(text, decision.finished)
        assert safe >= len(streamed), "safe_stream_len went backwards"
        assert text.startswith(streamed), "streamed text was taken back"
        streamed = text[:safe]
        if decision.finished:
            break
    return decision, text, streamed


def test_max_tokens_finishes_with_length() -> None:
    checker = StopChecker(SamplingParams(max_tokens=3), {EOS})
    decision, text, streamed = run(checker, [(5, "a"), (6, "b"), (7, "c"), (8, "d")])
    assert decision == StopDecision("length", None, 3)
    assert text == streamed == "abc"


def test_eos_stops_unless_ignore_eos() -> None:
    decision, text, _ = run(StopChecker(SamplingParams(), {EOS, 9}), [(5, "a"), (9, "")])
    assert (decision.finish_reason, decision.stop_reason, text) == ("stop", None, "a")
    checker = StopChecker(SamplingParams(ignore_eos=True, max_tokens=3), {EOS})
    decision, _, _ = run(checker, [(EOS, ""), (EOS, ""), (EOS, "")])
    assert decision.finish_reason == "length"
    # a single int is accepted as the EOS set
    assert StopChecker(SamplingParams(), EOS).check(EOS, 1, "", 0).finish_reason == "stop"


def test_stop_token_id_reports_the_id() -> None:
    checker = StopChecker(SamplingParams(stop_token_ids=[42]), {EOS})
    decision, text, streamed = run(checker, [(5, "x"), (42, "<sep>")])
    assert decision == StopDecision("stop", 42, len("x<sep>"))
    assert text == streamed == "x<sep>"


def test_min_tokens_defers_every_stop_but_length() -> None:
    params = SamplingParams(min_tokens=3, max_tokens=5, stop=["!"], stop_token_ids=[7])
    checker = StopChecker(params, {EOS})
    for num, token in ((1, EOS), (2, 7)):
        assert checker.check(token, num, "a!", 1).finish_reason is None
    assert checker.check(EOS, 3, "a!b", 1).finish_reason == "stop"
    assert checker.check(7, 3, "a!b", 1) == StopDecision("stop", 7, 3)
    assert checker.check(5, 3, "a!b!", 1) == StopDecision("stop", "!", 3)


def test_stop_string_split_across_tokens_is_cut_from_text() -> None:
    checker = StopChecker(SamplingParams(stop=["STOP", "\n\n"]), {EOS})
    pieces = [(1, "Hello S"), (2, "T"), (3, "O"), (4, "Pgarbage"), (5, "more")]
    decision, text, streamed = run(checker, pieces)
    assert decision == StopDecision("stop", "STOP", len("Hello "))
    assert text == streamed == "Hello "


def test_earliest_stop_string_wins() -> None:
    checker = StopChecker(SamplingParams(stop=["cd", "abcd", "b"]), {EOS})
    decision, text, _ = run(checker, [(1, "xa"), (2, "bcd")])
    assert (decision.stop_reason, text) == ("abcd", "x")  # starts before "b" and "cd"


def test_false_start_is_released() -> None:
    checker = StopChecker(SamplingParams(stop=["STOP"]), {EOS})
    assert checker.safe_stream_len("Hello ST") == len("Hello ")
    assert checker.safe_stream_len("Hello STO") == len("Hello ")
    assert checker.safe_stream_len("Hello STAR") == len("Hello STAR")
    assert checker.safe_stream_len("Hello STAR", finished=True) == len("Hello STAR")
    # no stop strings: nothing held back
    assert StopChecker(SamplingParams(), {EOS}).safe_stream_len("abc") == 3


@pytest.mark.parametrize("seed", range(30))
def test_streaming_never_retracts_random(seed: int) -> None:
    rng = random.Random(seed)
    alphabet = "ab "
    stops = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4))) for _ in range(2)]
    checker = StopChecker(SamplingParams(stop=stops, max_tokens=40), {EOS})
    pieces = [
        (10 + i, "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 3)))) for i in range(40)
    ]
    decision, text, streamed = run(checker, pieces)  # asserts no retraction at every step
    full = "".join(p for _, p in pieces)
    assert decision.finished and streamed == text
    first = min((full.find(s) for s in stops if s in full), default=-1)
    if decision.stop_reason is None:
        assert decision.finish_reason == "length" and first == -1
        assert text == full
    else:
        assert text == full[:first] and all(s not in text for s in stops)


def test_bad_num_new_chars() -> None:
    with pytest.raises(ValueError, match="num_new_chars"):
        StopChecker(SamplingParams(), {EOS}).check(1, 1, "ab", 3)


@pytest.mark.parametrize(
    "params,eos,token,num_out",
    [
        (SamplingParams(max_tokens=5), {2}, 2, 3),
        (SamplingParams(max_tokens=5, ignore_eos=True), {2}, 2, 3),
        (SamplingParams(max_tokens=5, stop_token_ids=[9]), {2}, 9, 3),
        (SamplingParams(max_tokens=5, min_tokens=4), {2}, 2, 3),
        (SamplingParams(max_tokens=4, min_tokens=4), {2}, 7, 4),
        (SamplingParams(max_tokens=5), {2}, 7, 5),
        (SamplingParams(max_tokens=5), {2}, 7, 4),
    ],
)
def test_check_token_agrees_with_check_without_text(params, eos, token, num_out):
    checker = StopChecker(params, eos)
    decision = checker.check(token, num_out, "", 0)
    assert checker.check_token(token, num_out) == (decision.finish_reason, decision.stop_reason)
