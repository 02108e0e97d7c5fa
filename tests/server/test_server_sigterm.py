"""SIGTERM on a daemon subprocess with a stream in flight: the stream completes, exit 0."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from server_helpers import BidiClient

from pydaemon.proto.pagedd.v1 import generation_pb2 as pb
from pydaemon.proto.pagedd.v1 import generation_pb2_grpc as pb_grpc

ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_serving(port: int, proc: subprocess.Popen, timeout: float = 60.0) -> grpc.Channel:
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    health = health_pb2_grpc.HealthStub(channel)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()
        try:
            if health.Check(health_pb2.HealthCheckRequest(), timeout=1).status == 1:
                return channel
        except grpc.RpcError:
            pass
        time.sleep(0.1)
    raise AssertionError("the daemon did not become SERVING")


def _drain_with_stream_in_flight(
    cmd: list[str], port: int, max_tokens: int, sig: int = signal.SIGTERM
) -> None:
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        channel = _wait_serving(port, proc)
        client = BidiClient(pb_grpc.GenerationStub(channel))
        sampling = pb.SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0)
        client.start("inflight", [3, 4, 5], sampling=sampling).close_send()
        assert client.next().HasField("delta")
        proc.send_signal(sig)
        frames = client.collect()["inflight"]
        assert frames[-1].finished.finish_reason == pb.FINISH_REASON_LENGTH
        assert frames[-1].finished.usage.completion_tokens == max_tokens
        out, _ = proc.communicate(timeout=30)
        assert proc.returncode == 0, out
        assert "draining: 1 live requests" in out, out
        channel.close()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def test_sigterm_drain_fake_engine_daemon():
    port = _free_port()
    cmd = [sys.executable, str(Path(__file__).parent / "fake_daemon.py"), str(port), "20"]
    _drain_with_stream_in_flight(cmd, port, max_tokens=60)


def test_sighup_drains_like_sigterm():
    """Issue 32, finding 8: SIGHUP (a closed terminal) used to kill the daemon undrained."""
    port = _free_port()
    cmd = [sys.executable, str(Path(__file__).parent / "fake_daemon.py"), str(port), "20"]
    _drain_with_stream_in_flight(cmd, port, max_tokens=60, sig=signal.SIGHUP)


def test_sigterm_drain_pagedd_serve_demo():
    if os.environ.get("PAGEDD_SERVER_TEST_ENGINE") == "fake":
        pytest.skip("PAGEDD_SERVER_TEST_ENGINE=fake")
    pytest.importorskip("pydaemon.engine.llm_engine", exc_type=ImportError)
    port = _free_port()
    cmd = [
        sys.executable,
        "-m",
        "pydaemon",
        "serve",
        "--model",
        "demo",
        "--device",
        "cpu",
        "--port",
        str(port),
        "--grace-period",
        "60",
    ]
    _drain_with_stream_in_flight(cmd, port, max_tokens=40)
