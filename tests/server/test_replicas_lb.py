"""Two daemons behind gRPC's own client-side load balancing (round_robin + health checking,
deploy/grpc_service_config.json): one is stopped (SIGTERM) mid-run and every request of the
client still succeeds: the stopped daemon drains what it has, health checking takes it out
of the rotation, and the rare request it refuses while draining (in-band UNAVAILABLE, before
any token) is sent again, as docs/serving.md's recipe says."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pydaemon.proto.pagedd.v1 import generation_pb2 as pb
from pydaemon.proto.pagedd.v1 import generation_pb2_grpc as pb_grpc

ROOT = Path(__file__).resolve().parents[2]
SERVICE_CONFIG = (ROOT / "deploy" / "grpc_service_config.json").read_text()
NUM_REQUESTS = 64
MAX_TOKENS = 32
WARMUP_TOKENS = 2  # the daemon's own warm-up request


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _daemon(port: int) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(
        [sys.executable, "-m", "pydaemon", "serve", "--model", "demo", "--device", "cpu",
         "--port", str(port), "--num-kv-blocks", "128", "--swap-space", "0",
         "--grace-period", "20", "--log-level", "warning"],
        cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


def _wait_serving(port: int, timeout_s: float = 120.0) -> None:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        for status in stub.Watch(
            health_pb2.HealthCheckRequest(), timeout=timeout_s, wait_for_ready=True
        ):
            if status.status == health_pb2.HealthCheckResponse.SERVING:
                return


def generate_with_retry(stub, request_id: str, attempts: int = 3) -> tuple[pb.Finished, int]:
    """One request; sent again when refused with in-band UNAVAILABLE before any token (a
    draining daemon did no work for it). Returns its Finished frame and the retries used."""
    sampling = pb.SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    start = pb.StartRequest(request_id=request_id, token_ids=pb.TokenIds(ids=[5, 6, 7]),
                            sampling=sampling)  # fmt: skip
    for attempt in range(attempts):
        frames = list(stub.Generate(iter([pb.GenerateRequest(start=start)]), timeout=60))
        last = frames[-1]
        if last.HasField("finished"):
            return last.finished, attempt
        refused = last.error.code == grpc.StatusCode.UNAVAILABLE.value[0] and len(frames) == 1
        assert refused, last
    raise AssertionError(f"{request_id}: refused {attempts} times")


@pytest.mark.timeout(180)
def test_round_robin_with_health_checking_survives_a_stopped_daemon():
    ports = [_free_port(), _free_port()]
    daemons = [_daemon(p) for p in ports]
    try:
        for port in ports:
            _wait_serving(port)
        target = "ipv4:" + ",".join(f"127.0.0.1:{p}" for p in ports)
        channel = grpc.insecure_channel(target, options=[("grpc.service_config", SERVICE_CONFIG)])
        stub = pb_grpc.GenerationStub(channel)
        done = threading.Semaphore(0)
        stopped = threading.Event()

        served_before_stop: list[int] = []

        def stop_first_daemon() -> None:
            for _ in range(NUM_REQUESTS // 4):
                done.acquire()
            for port in ports:  # both daemons took requests
                with grpc.insecure_channel(f"127.0.0.1:{port}") as direct:
                    status = pb_grpc.GenerationStub(direct).GetServerStatus(
                        pb.GetServerStatusRequest()
                    )
                served_before_stop.append(status.num_generation_tokens - WARMUP_TOKENS)
            daemons[0].send_signal(signal.SIGTERM)
            stopped.set()

        def one(i: int) -> tuple[pb.Finished, int]:
            try:
                return generate_with_retry(stub, f"r{i}")
            finally:
                done.release()

        stopper = threading.Thread(target=stop_first_daemon)
        stopper.start()
        with ThreadPoolExecutor(8) as pool:
            results = list(pool.map(one, range(NUM_REQUESTS)))
        stopper.join()
        assert stopped.is_set() and all(n > 0 for n in served_before_stop), served_before_stop
        assert all(f.usage.completion_tokens == MAX_TOKENS for f, _ in results)
        assert all(f.finish_reason == pb.FINISH_REASON_LENGTH for f, _ in results)
        assert daemons[0].wait(60) == 0  # drained and exited cleanly
        # The survivor served requests, and served alone after the stop.
        with grpc.insecure_channel(f"127.0.0.1:{ports[1]}") as direct:
            status = pb_grpc.GenerationStub(direct).GetServerStatus(pb.GetServerStatusRequest())
        # The survivor served its share before the stop and everything sent after it.
        assert status.num_generation_tokens - WARMUP_TOKENS > served_before_stop[1]
        channel.close()
    finally:
        for d in daemons:
            if d.poll() is None:
                d.kill()
                d.wait()
