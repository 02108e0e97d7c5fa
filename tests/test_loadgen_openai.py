"""`bench/loadgen.py --protocol openai`: a real, short run against `pagedd serve --http-port`
(demo model, CPU) in a subprocess, with the same metrics as through gRPC."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # bench/ is imported as a package from the repository root
    sys.path.insert(0, str(REPO))

pytest.importorskip("pydaemon._core", exc_type=ImportError)

from bench import loadgen  # noqa: E402

OUTPUT_LENS = (3, 5, 8)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def http_daemon():
    port, http_port = _free_port(), _free_port()
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    cmd = [sys.executable, "-m", "pydaemon", "serve", "--model", "demo", "--device", "cpu",
           "--port", str(port), "--http-port", str(http_port), "--num-kv-blocks", "256",
           "--log-level", "warning"]  # fmt: skip
    proc = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=subprocess.DEVNULL)
    yield f"127.0.0.1:{http_port}"
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()


def test_openai_protocol_run_reports_the_same_metrics(http_daemon, tmp_path, capsys):
    trace = tmp_path / "trace.jsonl"
    lines = [{"prompt": "Hello, my name is", "output_len": OUTPUT_LENS[0]},
             {"prompt_token_ids": [5, 6, 7, 8, 9, 10], "output_len": OUTPUT_LENS[1]},
             {"prompt": "The capital of France is", "output_len": OUTPUT_LENS[2]},
             {"prompt_token_ids": [7] * 3000, "output_len": 4}]  # longer than the context  # fmt: skip
    trace.write_text("".join(json.dumps(x) + "\n" for x in lines))
    out = tmp_path / "run.json"
    argv = ["--protocol", "openai", "--server", http_daemon, "--wait-ready", "90",
            "--workload", "jsonl", "--jsonl", str(trace), "--max-concurrency", "2",
            "--slo", "ttft_ms=60000,tpot_ms=60000", "--status-interval", "0.05",
            "--out", str(out), "--no-progress", "--no-plots"]  # fmt: skip
    assert loadgen.main(argv) == 0
    result = json.loads(out.read_text())
    assert result["meta"]["protocol"] == "openai"
    assert result["meta"]["model_info"] == {"model_name": "demo", "max_model_len": 2048,
                                            "vocab_size": 512}  # fmt: skip
    [run] = result["runs"]
    m = run["metrics"]
    assert (m["completed"], m["errors_by_status"]) == (3, {"HTTP_400": 1})
    assert m["total_output_tokens"] == sum(OUTPUT_LENS) and m["good_requests"] == 3
    ok = [r for r in run["requests"] if r["error_code"] is None]
    assert sorted(r["num_output_tokens"] for r in ok) == sorted(OUTPUT_LENS)
    for r in ok:
        assert sum(r["chunk_num_tokens"]) == r["num_output_tokens"]  # return_token_ids
        assert 0 < r["ttft_ms"] <= r["e2el_ms"]
        assert r["prompt_len"] > 0 and r["finish_reason"] == "length"
    bad = next(r for r in run["requests"] if r["error_code"] is not None)
    assert "maximum context length is 2048" in bad["error_message"]
    assert run["server_delta"]["num_generation_tokens"] == sum(OUTPUT_LENS)
    samples = run["server_status_samples"]
    assert samples and all(s["num_gpu_blocks"] == 256 for s in samples)
    assert "Serving Benchmark Result" in capsys.readouterr().out
