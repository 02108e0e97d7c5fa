"""SamplingParams validation: every bad value is a ValueError naming the field."""

from __future__ import annotations

import pytest

from pydaemon.sampling_params import MAX_ABS_LENGTH_PENALTY, SamplingParams


@pytest.mark.parametrize(
    "lp", [float("nan"), float("inf"), float("-inf"), 1e10, 200.0, -MAX_ABS_LENGTH_PENALTY - 1]
)
def test_length_penalty_out_of_range(lp) -> None:
    with pytest.raises(ValueError, match="length_penalty"):
        SamplingParams(beam_width=2, temperature=0.0, length_penalty=lp)


@pytest.mark.parametrize("lp", [-MAX_ABS_LENGTH_PENALTY, -1.0, 0.0, 1.0, MAX_ABS_LENGTH_PENALTY])
def test_length_penalty_in_range(lp) -> None:
    assert SamplingParams(beam_width=2, temperature=0.0, length_penalty=lp).length_penalty == lp
