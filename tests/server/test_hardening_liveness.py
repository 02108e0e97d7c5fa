"""A stuck engine core must not look healthy (issue 32, finding 5): past the stall timeout
without a step or heartbeat, gRPC health is NOT_SERVING and HTTP /health 503, and
GetServerStatus answers within its deadline; when the core moves again, health recovers."""

from __future__ import annotations

import threading
import time

import grpc
import pytest
from fake_engine import FakeEngine
from grpc_health.v1 import health_pb2, health_pb2_grpc
from http_helpers import request
from server_helpers import BidiClient

from pydaemon.entrypoints.grpc.servicer import ServingOptions
from pydaemon.proto.pagedd.v1 import generation_pb2 as pb

STALL_S = 0.5
STEP_S = 3.0  # one step this long: the core misses its heartbeat


def _grpc_health(st) -> int:
    with grpc.insecure_channel(st.address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        return stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=5).status


def _wait_for(predicate, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


def test_stuck_engine_core_is_not_serving_then_recovers(start_server):
    engine = FakeEngine(num_gpu_blocks=256, step_delay_s=0.002)
    st = start_server(
        lambda: engine,
        http_port=0,
        engine_stall_timeout_s=STALL_S,
        serving=ServingOptions(status_timeout_s=0.3),
    )
    serving = health_pb2.HealthCheckResponse.SERVING
    assert _grpc_health(st) == serving and request(st, "GET", "/health").status == 200
    client = BidiClient(st.stub())
    client.start("r", [3], sampling=pb.SamplingParams(max_tokens=8))
    client.close_send()
    first = client.next()  # streaming: it waits for the core (one with no output would fail)
    engine.step_delay_s = STEP_S
    frames: dict = {}
    threading.Thread(target=lambda: frames.update(client.collect())).start()
    t0 = time.monotonic()
    assert _wait_for(lambda: request(st, "GET", "/health").status == 503, STEP_S / 2)
    assert _wait_for(lambda: _grpc_health(st) != serving, STEP_S / 2)
    assert request(st, "GET", "/health").json()["error"]["code"] == "engine_stalled"
    status = st.stub().GetServerStatus(pb.GetServerStatusRequest(), timeout=STEP_S / 2)
    assert not status.is_serving
    assert time.monotonic() - t0 < STEP_S  # all of it while the step was still running
    engine.step_delay_s = 0.002
    assert _wait_for(lambda: _grpc_health(st) == serving, 3 * STEP_S)
    assert request(st, "GET", "/health").status == 200
    assert _wait_for(lambda: "r" in frames, 5.0)
    assert first.request_id == "r" and frames["r"][-1].finished.usage.completion_tokens == 8


def test_a_drained_server_lets_go_of_its_engine():
    """After drain, nothing the server object holds keeps the engine (and its C++ block
    manager) alive: whoever keeps a stopped server around does not keep the model."""
    import gc
    import weakref

    from conftest import make_server_thread

    engine = FakeEngine()
    ref = weakref.ref(engine)
    st = make_server_thread(lambda: ref())
    del engine
    st.close()  # drains
    gc.collect()
    assert st.server.is_drained.is_set()
    assert ref() is None


def test_new_requests_to_a_stuck_core_fail_fast(start_server):
    """Issue 46: while health said NOT_SERVING, new requests still waited for the stuck core
    until the client's own deadline; now UNAVAILABLE / 503 at once (no deadline reached)."""
    import openai
    from http_helpers import openai_client

    engine = FakeEngine(num_gpu_blocks=256, step_delay_s=0.002)
    st = start_server(lambda: engine, http_port=0, engine_stall_timeout_s=STALL_S)
    client = BidiClient(st.stub())
    client.start("r", [3], sampling=pb.SamplingParams(max_tokens=8))
    client.close_send()
    engine.step_delay_s = STEP_S
    first = threading.Thread(target=client.collect)
    first.start()
    assert _wait_for(lambda: request(st, "GET", "/health").status == 503, STEP_S / 2)
    late = BidiClient(st.stub())
    late.start("new", [5], sampling=pb.SamplingParams(max_tokens=2))
    [frame] = late.close_send().collect()["new"]
    assert frame.error.code == grpc.StatusCode.UNAVAILABLE.value[0]
    assert "stopped making progress" in frame.error.message
    http = openai_client(st, timeout=STEP_S / 2)
    for stream in (False, True):
        with pytest.raises(openai.InternalServerError) as e:
            http.completions.create(model="fake", prompt=[5], max_tokens=2, stream=stream)
        assert e.value.status_code == 503 and e.value.body["code"] == "engine_stalled"
    engine.step_delay_s = 0.002
    first.join(timeout=10 * STEP_S)  # the first request finishes once the core moves again


def test_requests_that_arrive_as_the_core_stops_fail_when_the_stall_is_declared(start_server):
    """Issue 55, 12: a request that arrived just after the core stopped (before the stall was
    declared) waited for its client's deadline; now every request still waiting for its first
    output ends UNAVAILABLE / 503 when the stall is declared. A stream that has begun waits for
    the core and finishes once it moves again."""
    import openai
    from http_helpers import openai_client

    engine = FakeEngine(num_gpu_blocks=256, step_delay_s=0.002)
    st = start_server(lambda: engine, http_port=0, engine_stall_timeout_s=STALL_S)
    streaming = BidiClient(st.stub())
    streaming.start("r", [3], sampling=pb.SamplingParams(max_tokens=8))
    streaming.close_send()
    assert streaming.next().request_id == "r"
    engine.step_delay_s = STEP_S  # the core's next step hangs: no progress for STEP_S
    t0 = time.monotonic()
    late = BidiClient(st.stub())
    late.start("late", [5], sampling=pb.SamplingParams(max_tokens=2))
    late.close_send()
    http_errors: dict = {}

    def http_request(stream: bool) -> None:
        http = openai_client(st, timeout=10 * STEP_S)
        try:
            http.completions.create(model="fake", prompt=[5], max_tokens=2, stream=stream)
        except openai.APIStatusError as e:
            http_errors[stream] = (e.status_code, e.body["code"], time.monotonic() - t0)

    threads = [threading.Thread(target=http_request, args=(s,)) for s in (False, True)]
    for thread in threads:
        thread.start()
    [frame] = late.collect()["late"]
    late_s = time.monotonic() - t0
    for thread in threads:
        thread.join(10 * STEP_S)
    assert frame.error.code == grpc.StatusCode.UNAVAILABLE.value[0], frame
    assert "stopped making progress" in frame.error.message
    assert late_s < STEP_S  # at the stall (~STALL_S), not when the step or the deadline ended
    for stream in (False, True):
        status, code, seconds = http_errors[stream]
        assert (status, code) == (503, "engine_stalled") and seconds < STEP_S
    engine.step_delay_s = 0.002
    rest = streaming.collect()["r"]  # the stream that had begun finishes once the core moves
    assert rest[-1].finished.usage.completion_tokens == 8
    assert _wait_for(lambda: _grpc_health(st) == health_pb2.HealthCheckResponse.SERVING, 10.0)
    again = BidiClient(st.stub())
    again.start("again", [5], sampling=pb.SamplingParams(max_tokens=2))
    assert again.close_send().collect()["again"][-1].finished.usage.completion_tokens == 2
