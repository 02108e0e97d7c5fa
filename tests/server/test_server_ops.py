"""Operations: health across start-up and drain, reflection, auth, metrics, sd_notify."""

from __future__ import annotations

import gc
import os
import shutil
import socket
import subprocess
import threading
import time
import urllib.request

import grpc
import pytest
from fake_engine import FakeEngine
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from server_helpers import BidiClient, ServerThread

from pydaemon.entrypoints.daemon.app import ServerOptions
from pydaemon.entrypoints.daemon.sd_notify import SdNotifier
from pydaemon.proto.pagedd.v1 import generation_pb2 as pb
from pydaemon.proto.pagedd.v1 import generation_pb2_grpc as pb_grpc

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def _health(channel, service: str = "") -> int:
    return (
        health_pb2_grpc.HealthStub(channel)
        .Check(health_pb2.HealthCheckRequest(service=service))
        .status
    )


def test_health_across_startup_and_drain():
    loaded = threading.Event()
    engine = FakeEngine(num_gpu_blocks=256, max_model_len=1024, step_delay_s=0.01)

    def slow_factory():
        loaded.wait(10)
        return engine

    st = ServerThread(ServerOptions(port=0, grace_period_s=5.0))
    try:
        st.listen()
        started = st.start_async(slow_factory)
        channel = grpc.insecure_channel(st.address)
        for service in ("", "pagedd.v1.Generation"):
            assert _health(channel, service) == NOT_SERVING
        # while loading, requests are refused in band as UNAVAILABLE
        client = BidiClient(pb_grpc.GenerationStub(channel))
        client.start("early", [3]).close_send()
        assert client.collect()["early"][0].error.code == grpc.StatusCode.UNAVAILABLE.value[0]
        loaded.set()
        started.result(10)
        for service in ("", "pagedd.v1.Generation"):
            assert _health(channel, service) == SERVING
        # a request in flight when the drain starts completes; a later one is refused
        inflight = BidiClient(pb_grpc.GenerationStub(channel))
        inflight.start("a", [3], sampling=pb.SamplingParams(max_tokens=30, ignore_eos=True))
        assert inflight.next().HasField("delta")
        drained = st.call(_drain_later(st), timeout=5)
        deadline = time.monotonic() + 5
        while _health(channel) != NOT_SERVING and time.monotonic() < deadline:
            time.sleep(0.01)
        assert _health(channel) == NOT_SERVING
        inflight.start("late", [4]).close_send()
        frames = inflight.collect()
        assert frames["a"][-1].finished.finish_reason == pb.FINISH_REASON_LENGTH
        assert frames["late"][0].error.code == grpc.StatusCode.UNAVAILABLE.value[0]
        drained.result(10)
        channel.close()
    finally:
        st.close()


async def _drain_later(st: ServerThread):
    import asyncio

    return asyncio.run_coroutine_threadsafe(st.server.drain(), st.loop)


def test_grace_period_over_aborts_what_is_left():
    engine = FakeEngine(num_gpu_blocks=1024, max_model_len=1024, step_delay_s=0.01)
    st = ServerThread(ServerOptions(port=0, grace_period_s=0.2)).start(lambda: engine)
    try:
        client = BidiClient(st.stub())
        client.start("a", [3], sampling=pb.SamplingParams(max_tokens=900, ignore_eos=True))
        assert client.next().HasField("delta")
        st.drain()
        frames = []
        with pytest.raises(grpc.RpcError) as e:  # the stream was left open: the call ends
            for frame in client.call:
                frames.append(frame)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        assert frames[-1].finished.finish_reason == pb.FINISH_REASON_ABORTED
        assert engine.stats.num_free_gpu_blocks == 1024
    finally:
        st.close()


def test_reflection_lists_the_service(start_server):
    st = start_server()
    stub = reflection_pb2_grpc.ServerReflectionStub(st.channel)
    responses = stub.ServerReflectionInfo(
        iter([reflection_pb2.ServerReflectionRequest(list_services="")])
    )
    names = {s.name for r in responses for s in r.list_services_response.service}
    assert {"pagedd.v1.Generation", "grpc.health.v1.Health"} <= names
    responses = stub.ServerReflectionInfo(
        iter(
            [reflection_pb2.ServerReflectionRequest(file_containing_symbol="pagedd.v1.Generation")]
        )
    )
    (response,) = list(responses)
    assert response.file_descriptor_response.file_descriptor_proto


def test_auth_refused_and_accepted_health_exempt(demo_server):
    st = demo_server(api_key="s3cret")
    stub = st.stub()
    with pytest.raises(grpc.RpcError) as e:
        stub.GetModelInfo(pb.GetModelInfoRequest())
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with pytest.raises(grpc.RpcError) as e:
        stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=[("authorization", "Bearer wrong")])
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    client = BidiClient(stub)
    client.start("a", [3]).close_send()
    with pytest.raises(grpc.RpcError) as e:
        client.collect()
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    auth = (("authorization", "Bearer s3cret"),)
    info = stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=auth)
    assert info.vocab_size > 3
    client = BidiClient(stub, metadata=auth)
    client.start("a", [3], sampling=pb.SamplingParams(max_tokens=2, ignore_eos=True)).close_send()
    assert client.collect()["a"][-1].finished.usage.completion_tokens == 2
    assert _health(st.channel) == SERVING  # no token needed


def test_unary_calls(start_server):
    st = start_server()
    stub = st.stub()
    info = stub.GetModelInfo(pb.GetModelInfoRequest())
    assert (info.model_name, info.vocab_size, info.max_model_len) == ("fake", 64, 64)
    assert info.has_tokenizer and info.num_gpu_blocks == 256
    tok = stub.Tokenize(pb.TokenizeRequest(text="ab", add_bos=True))
    assert list(tok.token_ids) == [1, 3 + ord("a") % 61, 3 + ord("b") % 61]
    assert len(tok.pieces) == 3
    status = stub.GetServerStatus(pb.GetServerStatusRequest())
    assert status.is_serving and status.num_gpu_blocks == 256 and status.num_free_gpu_blocks == 256


def _parse_prometheus(text: str) -> dict[str, float]:
    samples = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name, value = line.rsplit(" ", 1)
        samples[name] = float(value)
    return samples


def _scrape(st: ServerThread) -> dict[str, float]:
    url = f"http://127.0.0.1:{st.server.metrics_server.port}/metrics"
    with urllib.request.urlopen(url, timeout=5) as r:
        assert r.headers["Content-Type"].startswith("text/plain")
        return _parse_prometheus(r.read().decode())


def test_metrics_endpoint_scraped_and_parsed(demo_server):
    st = demo_server(metrics_port=0)
    before = _scrape(st)
    client = BidiClient(st.stub())
    for rid, prompt in (("a", [3, 4]), ("b", [5, 6])):
        client.start(rid, prompt, sampling=pb.SamplingParams(max_tokens=4, ignore_eos=True))
    client.close_send()
    client.collect()
    st.wait_all_blocks_free()
    samples = _scrape(st)
    assert samples["pagedd_kv_blocks_total"] == st.stats().num_gpu_blocks > 0
    assert samples["pagedd_kv_blocks_used"] == 0
    assert samples["pagedd_generation_tokens_total"] - before["pagedd_generation_tokens_total"] == 8
    assert 0 < samples["pagedd_prompt_tokens_total"] - before["pagedd_prompt_tokens_total"] <= 4
    assert samples['pagedd_requests_finished_total{finish_reason="length"}'] == 2
    assert samples["pagedd_time_to_first_token_seconds_count"] == 2
    assert samples['pagedd_e2e_request_latency_seconds_bucket{le="+Inf"}'] == 2
    assert samples["pagedd_time_per_output_token_seconds_count"] == 2
    assert samples["pagedd_num_requests_running"] == samples["pagedd_num_requests_waiting"] == 0
    for name in (
        "pagedd_preemptions_total",
        "pagedd_prefix_cache_hit_rate",
        "pagedd_swapped_out_blocks_total",
        "pagedd_kv_waste_slots",
        "pagedd_kv_cache_usage_ratio",
    ):
        assert name in samples


def test_sd_notify_on_a_real_unix_datagram_socket(tmp_path, monkeypatch):
    path = str(tmp_path / "notify.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    sock.settimeout(5)
    monkeypatch.setenv("WATCHDOG_USEC", "200000")  # 0.2 s: a WATCHDOG=1 every 0.1 s
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid()))
    engine = FakeEngine(num_gpu_blocks=64, max_model_len=64)
    st = ServerThread(ServerOptions(port=0), notifier=SdNotifier(path))
    gc.unfreeze()  # whatever an earlier test's engine froze
    try:
        st.start(lambda: engine)
        messages = []
        while not any(m.startswith("READY=1") for m in messages):
            messages.append(sock.recv(4096).decode())
        assert messages[0] == "STATUS=loading the model", messages
        assert messages[-1].startswith("READY=1\nSTATUS=serving fake on 127.0.0.1:"), messages
        assert sock.recv(4096).decode() == "WATCHDOG=1"  # the engine loop is making progress
        # Ready: the front process's heap is frozen out of full collections (heap_freeze.py)
        assert gc.get_freeze_count() > 1000
        st.drain()
        messages = []
        while not any("STOPPING=1" in m for m in messages):
            messages.append(sock.recv(4096).decode())
        assert gc.get_freeze_count() == 0  # drained: thawed
    finally:
        st.close()
        sock.close()


def test_no_watchdog_when_the_engine_loop_is_stuck(tmp_path, monkeypatch):
    path = str(tmp_path / "notify.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    monkeypatch.setenv("WATCHDOG_USEC", "200000")
    monkeypatch.delenv("WATCHDOG_PID", raising=False)
    engine = FakeEngine(num_gpu_blocks=1024, max_model_len=1024, step_delay_s=2.0)  # a hung step
    st = ServerThread(ServerOptions(port=0, grace_period_s=0.0), notifier=SdNotifier(path))
    try:
        st.start(lambda: engine)
        client = BidiClient(st.stub()).start("a", [3])
        time.sleep(0.6)  # the step is now stuck for longer than the watchdog timeout
        sock.settimeout(0.01)
        try:
            while True:
                sock.recv(4096)
        except TimeoutError:
            pass
        sock.settimeout(0.5)
        with pytest.raises(TimeoutError):
            while True:
                assert "WATCHDOG=1" not in sock.recv(4096).decode()
        client.call.cancel()
    finally:
        st.close()
        sock.close()


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs openssl to make a certificate")
def test_tls(start_server, tmp_path):
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-subj",
            "/CN=localhost",
            "-addext",
            "subjectAltName=DNS:localhost",
            "-keyout",
            str(key),
            "-out",
            str(cert),
        ],
        check=True,
        capture_output=True,
    )
    st = start_server(tls_cert=str(cert), tls_key=str(key))
    credentials = grpc.ssl_channel_credentials(cert.read_bytes())
    with grpc.secure_channel(f"localhost:{st.server.port}", credentials) as channel:
        info = pb_grpc.GenerationStub(channel).GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
        assert info.model_name == "fake"
    with grpc.insecure_channel(f"localhost:{st.server.port}") as channel:
        with pytest.raises(grpc.RpcError):
            pb_grpc.GenerationStub(channel).GetModelInfo(pb.GetModelInfoRequest(), timeout=2)


def test_unexpected_exception_becomes_internal_with_a_log_line(start_server, caplog):
    st = start_server()

    async def broken():
        raise KeyError("boom")

    st.server.async_engine.stats = broken  # GetServerStatus awaits it
    with pytest.raises(grpc.RpcError) as e:
        st.stub().GetServerStatus(pb.GetServerStatusRequest())
    assert e.value.code() == grpc.StatusCode.INTERNAL
    assert "boom" in e.value.details()
    assert any(
        "unexpected error in /pagedd.v1.Generation/GetServerStatus" in r.message
        for r in caplog.records
    )
    assert _health(st.channel) == SERVING


def test_vllm_named_gauges_for_routers(start_server):
    """Issue 32, finding 10: what the Gateway API Inference Extension and llm-d read."""

    engine = FakeEngine(num_gpu_blocks=64, max_model_len=1024, step_delay_s=0.01)
    st = start_server(lambda: engine, metrics_port=0)
    client = BidiClient(st.stub())
    client.start("a", [3, 4], sampling=pb.SamplingParams(max_tokens=200, ignore_eos=True))
    client.close_send()
    done = threading.Thread(target=client.collect)
    done.start()
    time.sleep(0.3)
    samples = _scrape(st)
    label = '{model_name="fake"}'
    assert samples[f"vllm:num_requests_running{label}"] == 1
    assert samples[f"vllm:num_requests_waiting{label}"] == 0
    usage = samples[f"vllm:kv_cache_usage_perc{label}"]
    assert usage == samples["pagedd_kv_cache_usage_ratio"] and 0 < usage < 1
    done.join()
