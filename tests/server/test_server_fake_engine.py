"""Stream semantics against the fake engine (fast, deterministic)."""

from __future__ import annotations

import grpc
import pytest
from fake_engine import FakeEngine
from server_helpers import BidiClient, ServerThread, joined_ids

from pydaemon.proto.pagedd.v1 import generation_pb2 as pb


@pytest.fixture
def fake_server():
    engines = []

    def start(**engine_kw) -> ServerThread:
        st = ServerThread()
        engine = FakeEngine(**engine_kw)
        engines.append(st)
        return st.start(lambda: engine)

    yield start
    for st in engines:
        st.close()


def test_three_interleaved_requests_on_one_stream(fake_server):
    st = fake_server(step_delay_s=0.002)
    client = BidiClient(st.stub())
    for rid, max_tokens in (("a", 5), ("b", 9), ("c", 3)):
        client.start(rid, [10, 11, 12], sampling=pb.SamplingParams(max_tokens=max_tokens))
    client.close_send()
    frames = client.collect()
    assert sorted(frames) == ["a", "b", "c"]
    for rid, max_tokens in (("a", 5), ("b", 9), ("c", 3)):
        *deltas, last = frames[rid]
        assert last.finished.finish_reason == pb.FINISH_REASON_LENGTH
        assert joined_ids(deltas) == [(12 + 1 + k) % 64 for k in range(max_tokens)]
        assert last.finished.usage.prompt_tokens == 3
        assert last.finished.usage.completion_tokens == max_tokens
        assert last.finished.timings.total_ms > 0
    assert st.wait_all_blocks_free().num_running == 0


def test_engine_failure_is_internal_in_band_and_health_goes_on(fake_server):
    st = fake_server(fail_on_step=1)
    client = BidiClient(st.stub())
    client.start("x", [5], sampling=pb.SamplingParams(max_tokens=4)).close_send()
    (frame,) = client.collect()["x"]
    assert frame.error.code == grpc.StatusCode.INTERNAL.value[0]
    assert "simulated internal failure" in frame.error.message
    # a later request is refused as UNAVAILABLE: the engine is dead
    client = BidiClient(st.stub())
    client.start("y", [5]).close_send()
    (frame,) = client.collect()["y"]
    assert frame.error.code == grpc.StatusCode.UNAVAILABLE.value[0]
