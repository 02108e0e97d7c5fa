"""`pagedd serve --http-port`: the OpenAI API of a real daemon process (chat out of the box),
and SIGTERM draining an HTTP stream in flight (the stream completes, the daemon exits 0)."""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from http_helpers import MODEL, sse_payloads

ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_healthy(port: int, proc: subprocess.Popen, timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=1)
            conn.request("GET", "/health")
            if conn.getresponse().status == 200:
                return
        except OSError:
            pass
        time.sleep(0.2)
    raise AssertionError("the daemon's /health did not answer 200")


def test_sigterm_drains_an_http_stream_and_exits_0():
    if os.environ.get("PAGEDD_SERVER_TEST_ENGINE") == "fake":
        pytest.skip("PAGEDD_SERVER_TEST_ENGINE=fake")
    port, http_port = _free_port(), _free_port()
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    cmd = [sys.executable, "-m", "pydaemon", "serve", "--model", "demo", "--device", "cpu",
           "--num-kv-blocks", "128", "--port", str(port), "--http-port", str(http_port)]  # fmt: skip
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        _wait_healthy(http_port, proc)
        conn = http.client.HTTPConnection("127.0.0.1", http_port, timeout=30)
        chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi!"}], "max_tokens": 3,
                "ignore_eos": True}  # fmt: skip
        conn.request("POST", "/v1/chat/completions", body=json.dumps(chat),
                     headers={"Content-Type": "application/json"})  # fmt: skip
        reply = json.loads(conn.getresponse().read())  # the demo model's template, out of the box
        assert reply["usage"]["completion_tokens"] == 3, reply
        assert reply["choices"][0]["message"]["role"] == "assistant"
        body = {"model": MODEL, "prompt": "Hello world", "max_tokens": 40, "temperature": 0,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
        conn.request("POST", "/v1/completions", body=json.dumps(body),
                     headers={"Content-Type": "application/json"})  # fmt: skip
        response = conn.getresponse()
        assert response.status == 200
        assert response.readline().startswith(b"data: ")
        proc.send_signal(signal.SIGTERM)
        payloads = sse_payloads(response.read().decode())
        assert payloads[-1] == "[DONE]"
        assert json.loads(payloads[-2])["usage"]["completion_tokens"] == 40
        assert json.loads(payloads[-3])["choices"][0]["finish_reason"] == "length"
        out, _ = proc.communicate(timeout=30)
        assert proc.returncode == 0, out
        assert f"OpenAI API on http://127.0.0.1:{http_port}/v1" in out, out
        assert "draining: 1 live requests" in out, out
        _check_start_up_progress(out)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def _check_start_up_progress(out: str) -> None:
    """Issue 55 item 18: start-up said nothing for 45-58 s and its first line was the whole
    configuration. Now a line for each stage, in order, and the settings given, not forty."""
    first = out.splitlines()[0]
    assert "starting demo (--device cpu, --num-kv-blocks 128)" in first, first
    assert "EngineConfig(" not in out
    stages = ["starting the engine core", "loading the weights", "weights loaded in",
              "KV cache:", "warming up", "warm-up done in", "ready in"]  # fmt: skip
    where = [out.find(stage) for stage in stages]
    assert -1 not in where and where == sorted(where), dict(zip(stages, where, strict=True))
