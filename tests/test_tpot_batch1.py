"""bench/tpot_batch1.py on the demo model (CPU): every streamed token is counted, so TPOT is
the decode time over the output tokens after the first, close to one decode step."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

REPO_ROOT = str(Path(__file__).resolve().parent.parent)
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)

pytest.importorskip("pydaemon._core", exc_type=ImportError)

from bench import tpot_batch1  # noqa: E402


def test_counts_every_token_and_tpot_is_about_one_step(tmp_path):
    out = tmp_path / "tpot.json"
    argv = ["--model", "demo", "--device", "cpu", "--prompt-len", "24", "--output-len", "12",
            "--runs", "2", "--modes", "eager", "--out", str(out)]  # fmt: skip
    assert tpot_batch1.main(argv) == 0
    result = json.loads(out.read_text())["results"]["eager"]
    for run in result["runs"]:
        assert run["output_tokens"] == 12
        assert 0 < run["ttft_ms"]
        # 11 decode steps after the first token: TPOT is their mean, near the median step
        assert 0.3 < run["tpot_ms"] / run["median_decode_step_ms"] < 3.0
