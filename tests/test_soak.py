"""A short soak in CI: bench/soak.py against a spawned demo daemon must lose no request, leak
no KV block, keep its RSS bounded and exit cleanly."""

from __future__ import annotations

import json

from bench import soak


def test_short_soak_passes(tmp_path, capsys):
    out = tmp_path / "soak.json"
    code = soak.main(
        ["--num-requests", "300", "--concurrency", "16", "--serve-args",
         "--num-kv-blocks 48 --swap-space 0.01", "--out", str(out)]
    )  # fmt: skip
    report = json.loads(out.read_text())
    assert code == 0, {k: report[k] for k in ("checks", "losses", "outcomes")}
    assert report["num_requests"] == 300 and report["num_losses"] == 0
    assert report["kv_blocks"]["free_at_end"] == report["kv_blocks"]["total"] == 48
    # the run really exercised every way a request can end
    outcomes = report["outcomes"]
    for outcome in ("finished:length", "finished:cancelled", "finished:time_limit"):
        assert outcomes.get(outcome, 0) > 0, outcomes
    assert report["call_statuses"].get("CANCELLED", 0) > 0
    assert set(report["request_kinds"]) == {
        "plain",
        "cancel",
        "time_limit",
        "n",
        "beam",
        "text",
        "chat",
    }
