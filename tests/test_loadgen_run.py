"""A real, short loadgen run against `pagedd serve --model demo` (CPU) in a subprocess."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = str(Path(__file__).resolve().parent.parent)
if REPO_ROOT not in sys.path:  # bench/ is imported as a package from the repository root
    sys.path.insert(0, REPO_ROOT)

pytest.importorskip("pydaemon._core", exc_type=ImportError)

from bench import loadgen  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
OUTPUT_LENS = (3, 5, 8)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def daemon():
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    cmd = [sys.executable, "-m", "pydaemon", "serve", "--model", "demo", "--device", "cpu",
           "--port", str(port), "--num-kv-blocks", "256", "--log-level", "warning"]  # fmt: skip
    proc = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=subprocess.DEVNULL)
    yield f"127.0.0.1:{port}"
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()


@pytest.mark.parametrize("protocol", ["grpc", "grpc-mux"])
def test_sweep_writes_json_and_plots(daemon, tmp_path, capsys, protocol):
    trace = tmp_path / "trace.jsonl"
    lines = [{"prompt": "Hello, my name is", "output_len": OUTPUT_LENS[0]},
             {"prompt_token_ids": [5, 6, 7, 8, 9, 10], "output_len": OUTPUT_LENS[1]},
             {"prompt": "The capital of France is", "output_len": OUTPUT_LENS[2]},
             {"prompt_token_ids": [7] * 3000, "output_len": 4}]  # longer than the context  # fmt: skip
    trace.write_text("".join(json.dumps(x) + "\n" for x in lines))
    out = tmp_path / "run.json"
    argv = ["--server", daemon, "--protocol", protocol, "--wait-ready", "90",
            "--workload", "jsonl", "--jsonl", str(trace),
            "--sweep-rates", "40,inf", "--max-concurrency", "2", "--num-channels", "2",
            "--slo", "ttft_ms=60000,tpot_ms=60000", "--status-interval", "0.05",
            "--out", str(out), "--no-progress"]  # fmt: skip
    assert loadgen.main(argv) == 0
    result = json.loads(out.read_text())  # strict JSON: NaN would fail here
    meta = result["meta"]
    assert meta["model_info"]["model_name"] == "demo" and meta["cpu"] and meta["date"]
    assert "--sweep-rates 40,inf" in meta["command"] and meta["git_commit"]
    assert [r["config"]["request_rate"] for r in result["runs"]] == [40.0, "inf"]
    for run in result["runs"]:
        m = run["metrics"]
        assert (m["completed"], m["errors_by_status"]) == (3, {"INVALID_ARGUMENT": 1})
        assert m["total_output_tokens"] == sum(OUTPUT_LENS)  # EOS ignored by default
        assert m["good_requests"] == 3
        ok = [r for r in run["requests"] if r["error_code"] is None]
        assert sorted(r["num_output_tokens"] for r in ok) == sorted(OUTPUT_LENS)
        for r in ok:
            assert 0 < r["ttft_ms"] <= r["e2el_ms"]
            assert len(r["chunk_times_s"]) == len(r["chunk_num_tokens"]) >= 1
            assert r["chunk_times_s"] == sorted(r["chunk_times_s"])
            assert r["prompt_len"] > 0 and r["finish_reason"] == "length"
        assert max(run["timeseries"]["requests_in_flight"]) <= 2 + 1e-9  # --max-concurrency
        assert run["server_delta"]["num_generation_tokens"] == sum(OUTPUT_LENS)
        assert run["server_status_samples"]
    printed = capsys.readouterr().out
    assert "Serving Benchmark Result" in printed and "Output token throughput" in printed
    if _has_matplotlib():
        for name in ("run_sweep.png", "run_rate40_latency.png", "run_rateinf_timeline.png"):
            assert (tmp_path / name).stat().st_size > 1000, name


def test_unreachable_server_is_a_clear_error(tmp_path, capsys):
    code = loadgen.main(["--server", f"127.0.0.1:{_free_port()}", "--workload", "fixed",
                         "--out", str(tmp_path / "x.json"), "--no-plots"])  # fmt: skip
    assert code == 2
    assert "UNAVAILABLE" in capsys.readouterr().err


def _has_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.mark.parametrize("cache_salt", ["run", "none"])
def test_cache_salt_keeps_runs_from_hitting_each_others_prefixes(daemon, tmp_path, cache_salt):
    trace = tmp_path / "trace.jsonl"
    prompts = [[100 + 7 * i + j for j in range(40)] for i in range(3)]  # 2 full blocks each
    trace.write_text("".join(json.dumps({"prompt_token_ids": p, "output_len": 2}) + "\n"
                             for p in prompts))  # fmt: skip
    out = tmp_path / "run.json"
    argv = ["--server", daemon, "--wait-ready", "90", "--workload", "jsonl", "--jsonl", str(trace),
            "--sweep-rates", "inf,inf", "--max-concurrency", "1", "--cache-salt", cache_salt,
            "--out", str(out), "--no-progress", "--no-plots", "--quiet"]  # fmt: skip
    assert loadgen.main(argv) == 0
    second = json.loads(out.read_text())["runs"][1]
    hits = second["server_delta"]["prefix_cache_hit_tokens"]
    if cache_salt == "run":
        assert hits == 0
    else:
        assert hits >= 3 * 32


def test_without_out_nothing_is_written(daemon, tmp_path, monkeypatch, capsys):
    """Issue 55 item 20: results went into the repository's bench/results/ by default. Without
    --out, a run prints its table and writes nothing, wherever it runs from."""
    results = REPO / "bench" / "results"
    before = set(results.iterdir())
    monkeypatch.chdir(tmp_path)
    argv = ["--server", daemon, "--wait-ready", "90", "--workload", "fixed", "--num-requests",
            "2", "--input-len", "4", "--output-len", "2", "--no-progress"]  # fmt: skip
    assert loadgen.main(argv) == 0
    assert set(results.iterdir()) == before
    assert list(tmp_path.iterdir()) == []
    captured = capsys.readouterr()
    assert "Serving Benchmark Result" in captured.out and "--out FILE.json" in captured.err
