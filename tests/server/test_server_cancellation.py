"""Every way a request ends early frees all of its KV blocks at once."""

from __future__ import annotations

import time

import grpc
import pytest
from fake_engine import FakeEngine
from server_helpers import BidiClient

from pydaemon.proto.pagedd.v1 import generation_pb2 as pb

LONG = pb.SamplingParams(max_tokens=500, ignore_eos=True)


def _long_engine():
    from conftest import shared_demo_engine

    return shared_demo_engine


def _wait_for_delta(client: BidiClient, request_id: str) -> None:
    frame = client.next()
    assert frame.request_id == request_id and frame.HasField("delta"), frame


def test_cancel_frame_frees_blocks_and_reports_cancelled(start_server):
    st = start_server(_long_engine())
    total = st.stats().num_gpu_blocks
    client = BidiClient(st.stub())
    client.start("a", [3, 4, 5], sampling=LONG)
    first = client.next()
    assert first.HasField("delta")
    assert st.stats().num_free_gpu_blocks < total
    client.cancel("a").close_send()
    frames = [first, *client.collect()["a"]]
    assert frames[-1].finished.finish_reason == pb.FINISH_REASON_CANCELLED
    assert frames[-1].finished.usage.completion_tokens == sum(
        len(f.delta.token_ids) for f in frames[:-1]
    )
    assert st.wait_all_blocks_free().num_free_gpu_blocks == total


def test_client_disconnect_frees_blocks(start_server):
    st = start_server(_long_engine())
    total = st.stats().num_gpu_blocks
    client = BidiClient(st.stub())
    client.start("a", [3], sampling=LONG).start("b", [4], sampling=LONG)
    assert client.next().HasField("delta")
    client.call.cancel()
    assert st.wait_all_blocks_free().num_free_gpu_blocks == total
    assert st.stats().num_running == 0


def test_deadline_frees_blocks(start_server):
    st = start_server(_long_engine())
    total = st.stats().num_gpu_blocks
    client = BidiClient(st.stub(), timeout=0.5)
    client.start("a", [3], sampling=LONG)
    with pytest.raises(grpc.RpcError) as e:
        client.collect()
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert st.wait_all_blocks_free().num_free_gpu_blocks == total


def test_time_limit_ends_request_with_time_limit(start_server):
    st = start_server(_long_engine())
    total = st.stats().num_gpu_blocks
    client = BidiClient(st.stub())
    t0 = time.monotonic()
    client.start("a", [3], sampling=LONG, time_limit_ms=200).close_send()
    last = client.collect()["a"][-1]
    assert last.finished.finish_reason == pb.FINISH_REASON_TIME_LIMIT
    assert 0.2 <= time.monotonic() - t0 < 2.0
    assert 0 < last.finished.usage.completion_tokens < 500
    assert st.wait_all_blocks_free().num_free_gpu_blocks == total


def test_other_requests_on_the_stream_survive_a_cancel(start_server):
    st = start_server(_long_engine())
    client = BidiClient(st.stub())
    client.start("long", [3], sampling=LONG)
    client.start("short", [4], sampling=pb.SamplingParams(max_tokens=20, ignore_eos=True))
    client.cancel("long").close_send()
    frames = client.collect()
    assert frames["long"][-1].finished.finish_reason == pb.FINISH_REASON_CANCELLED
    assert frames["short"][-1].finished.finish_reason == pb.FINISH_REASON_LENGTH
    assert frames["short"][-1].finished.usage.completion_tokens == 20


def test_admission_control_resource_exhausted_in_band(start_server):
    engine = FakeEngine(num_gpu_blocks=4096, max_model_len=1024, step_delay_s=0.05)
    st = start_server(lambda: engine, serving=_serving(max_queued_requests=2))
    client = BidiClient(st.stub())
    for i in range(8):
        client.start(f"r{i}", [3], sampling=pb.SamplingParams(max_tokens=2))
    client.close_send()
    frames = client.collect()
    codes = [f[-1].error.code if f[-1].HasField("error") else 0 for f in frames.values()]
    assert codes.count(grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]) >= 1
    assert codes.count(0) >= 2
    assert set(codes) <= {0, grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]}


def test_stalled_reader_has_its_requests_aborted(start_server):
    # Deltas of ~64 KiB fill the HTTP/2 window quickly when the client does not read.
    engine = FakeEngine(num_gpu_blocks=1 << 16, max_model_len=1 << 16, step_delay_s=0.001)
    engine.tokenizer.decode = lambda ids: "x" * 65536
    st = start_server(lambda: engine, serving=_serving(stall_timeout_s=0.5))
    total = st.stats().num_gpu_blocks
    client = BidiClient(st.stub())
    client.start("a", [3], sampling=pb.SamplingParams(max_tokens=5000, ignore_eos=True))
    _wait_for_delta(client, "a")
    time.sleep(2.0)  # not reading
    assert st.wait_all_blocks_free().num_free_gpu_blocks == total
    with pytest.raises(grpc.RpcError) as e:
        client.collect()
    assert e.value.code() == grpc.StatusCode.ABORTED


def _serving(**kw):
    from pydaemon.entrypoints.grpc.servicer import ServingOptions

    return ServingOptions(**kw)
