"""bench/issue41_suite.sh and its summary (bench/issue41_summary.py) without a GPU: the script
parses, every JSON it writes is one the summary reads, and the summary's ratios come out of
hand-made result files as defined (FP8 over bf16 at the same token count, pagedd over vLLM as
speed, the routing at batch 64 next to uniform's expectation)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from bench import issue41_summary, moe_routing  # noqa: E402

SUITE = REPO_ROOT / "bench" / "issue41_suite.sh"


def test_the_suite_parses():
    subprocess.run(["bash", "-n", str(SUITE)], check=True)


def test_every_file_the_suite_writes_is_summarized():
    text = SUITE.read_text()
    written = set(re.findall(r'--out "\$out/([\w${}]+)\.json"', text))
    known = {stem for stem, _, _ in issue41_summary.LAYERS} | set(issue41_summary.DENSE)
    known |= {f"engine_{m}_{q}_pagedd" for m, q in issue41_summary.ENGINES}
    for stem in sorted(written):
        if "$" in stem:  # the loops' names: engine_${m}_..., prefill_$tag, profile_step_...
            continue
        assert stem in known or stem.startswith("profile_"), stem
    assert "engine_${m}_bf16_vllm" in written and "prefill_$tag" in written


def _write(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data))


def _layer(out: Path, stem: str, rows: list[tuple[int, float]]) -> None:
    _write(out / f"{stem}.json", {"rows": [
        {"tokens": t, "total_ms": ms, "experts_hit": 8, "of_floor": 0.5} for t, ms in rows
    ]})  # fmt: skip


def _engine(out: Path, stem: str, w1: float, b1: float, b64: float, hist: list[int]) -> None:
    raw = {"layers": [0], "num_experts": 4, "top_k": 2, "hist": [hist],
           "by_tokens": {64: [6, 2]}}  # two layer calls at T=64, 3 experts each  # fmt: skip
    routing = {"router_seed": 0, "tpot_batch64": moe_routing.summarize(raw)}
    _write(out / f"{stem}.json", {"results": [{
        "wall_s": w1, "tpot_batch1": {"tpot_ms": b1}, "tpot_batch": {"tpot_ms": b64},
        "moe_routing": routing,
    }]})  # fmt: skip


def test_summary_ratios(tmp_path, capsys):
    _layer(tmp_path, "layer_qwen3_bf16", [(1, 0.10), (64, 0.40)])
    _layer(tmp_path, "layer_qwen3_fp8", [(1, 0.05), (64, 0.50)])
    _engine(tmp_path, "engine_qwen3_fp8_pagedd", 10.0, 4.0, 8.0, [4, 4, 4, 4])
    _engine(tmp_path, "engine_qwen3_fp8_vllm", 12.0, 4.0, 6.0, [8, 4, 2, 2])
    assert issue41_summary.main([str(tmp_path)]) == 0
    summary = json.loads((tmp_path / "issue41_summary.json").read_text())
    fp8 = {r["tokens"]: r["vs_bf16"] for r in summary["layer"] if "FP8" in r["variant"]}
    assert fp8 == {1: pytest.approx(2.0), 64: pytest.approx(0.8)}
    (row,) = summary["engines"]
    assert row["pagedd_over_vllm"] == {"w1_s": pytest.approx(1.2), "tpot_b1_ms": pytest.approx(1.0),
                                       "tpot_b64_ms": pytest.approx(0.75)}  # fmt: skip
    b64 = row["vllm"]["routing_b64"]
    assert b64["step_tokens"] == 64 and b64["experts_touched"] == pytest.approx(3.0)
    assert b64["uniform"] == pytest.approx(moe_routing.uniform_experts_touched(4, 2, 64))
    assert b64["max_over_mean"] == pytest.approx(2.0)
    assert row["pagedd"]["routing_b64"]["max_over_mean"] == pytest.approx(1.0)
    printed = capsys.readouterr().out
    assert "pagedd/vLLM W1 1.20x" in printed and "b64 0.75x" in printed


def test_summary_of_an_empty_run(tmp_path, capsys):
    assert issue41_summary.main([str(tmp_path)]) == 0
    assert json.loads((tmp_path / "issue41_summary.json").read_text())["engines"] == []
