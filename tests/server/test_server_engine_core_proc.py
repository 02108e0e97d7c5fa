"""`pagedd serve` runs the engine core in its own process. Kill the core mid-stream: every open
stream ends UNAVAILABLE within seconds and the daemon exits non-zero. Kill the front end: the
core exits too."""

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


def _is_running(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    state = next(line for line in status.splitlines() if line.startswith("State:"))
    return "Z" not in state.split()[1]


def _engine_core_pid(daemon_pid: int) -> int:
    """The daemon's spawned child (not multiprocessing's resource tracker)."""
    children = [
        int(task_children)
        for task in Path(f"/proc/{daemon_pid}/task").iterdir()
        for task_children in (task / "children").read_text().split()
    ]  # the core is spawned from a worker thread: every thread's children
    for child in children:
        cmdline = Path(f"/proc/{child}/cmdline").read_bytes().replace(b"\0", b" ")
        if b"spawn_main" in cmdline:
            return child
    raise AssertionError(f"no engine-core child among {children}")


@pytest.fixture
def daemon():
    if not Path("/proc/self/task").is_dir():
        pytest.skip("needs /proc (Linux)")
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    cmd = [sys.executable, "-m", "pydaemon", "serve", "--model", "demo", "--device", "cpu"]
    proc = subprocess.Popen(
        [*cmd, "--port", str(port), "--grace-period", "5"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    health = health_pb2_grpc.HealthStub(channel)
    deadline = time.monotonic() + 120
    while True:
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "the daemon did not become SERVING"
        try:
            if health.Check(health_pb2.HealthCheckRequest(), timeout=1).status == 1:
                break
        except grpc.RpcError:
            pass
        time.sleep(0.1)
    yield proc, channel
    channel.close()
    if proc.poll() is None:
        proc.kill()
        proc.communicate()


def _long_stream(channel: grpc.Channel, request_id: str) -> BidiClient:
    client = BidiClient(pb_grpc.GenerationStub(channel), timeout=60)
    sampling = pb.SamplingParams(max_tokens=400, ignore_eos=True, temperature=0)
    client.start(request_id, [3, 4, 5], sampling=sampling)
    assert client.next().HasField("delta")
    return client


def test_killing_the_engine_core_ends_every_stream_unavailable_and_the_daemon_exits_1(daemon):
    proc, channel = daemon
    info = pb_grpc.GenerationStub(channel).GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
    assert (info.device, info.dtype) == ("cpu", "float32")  # the real ones, not "auto"
    core_pid = _engine_core_pid(proc.pid)
    streams = [_long_stream(channel, f"r{i}") for i in range(2)]
    os.kill(core_pid, signal.SIGKILL)
    started = time.monotonic()
    for client in streams:
        with pytest.raises(grpc.RpcError) as e:
            client.collect()
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE, e.value.details()
        assert "engine" in e.value.details()
    assert time.monotonic() - started < 15  # generous: test machines are shared
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 1, out


def test_killing_the_front_end_makes_the_engine_core_exit(daemon):
    proc, channel = daemon
    core_pid = _engine_core_pid(proc.pid)
    _long_stream(channel, "r")
    proc.kill()
    proc.communicate()
    deadline = time.monotonic() + 30
    while _is_running(core_pid):
        assert time.monotonic() < deadline, "the engine core outlived its front end"
        time.sleep(0.05)
