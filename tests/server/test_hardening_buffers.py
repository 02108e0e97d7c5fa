"""Bounded per-stream buffers (issue 32, finding 7): a gRPC client that stops reading makes
its requests wait (their deltas merge in the engine client) instead of queueing a frame per
token without bound; once it reads again, every token arrives."""

from __future__ import annotations

import time

from fake_engine import FakeEngine
from server_helpers import BidiClient, joined_ids

from pydaemon.entrypoints.grpc import servicer as servicer_module
from pydaemon.proto.pagedd.v1 import generation_pb2 as pb

NUM_REQUESTS = 24
MAX_TOKENS = 3000


def test_slow_reader_stream_buffer_is_bounded(start_server, monkeypatch):
    monkeypatch.setattr(servicer_module, "_MAX_BUFFERED_FRAMES", 512, raising=False)
    engine = FakeEngine(num_gpu_blocks=1 << 16, max_model_len=8192, step_delay_s=0.0005)
    st = start_server(lambda: engine)
    client = BidiClient(st.stub())
    sampling = pb.SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    for i in range(NUM_REQUESTS):
        client.start(f"r{i}", [3], sampling=sampling)
    client.close_send()
    while not st.server.servicer._streams:
        time.sleep(0.01)
    (stream,) = st.server.servicer._streams
    peak = 0
    deadline = time.monotonic() + 3.0
    while time.monotonic() < deadline:  # not reading
        peak = max(peak, stream.out.qsize())
        time.sleep(0.01)
    assert peak <= 512 + 2 * NUM_REQUESTS
    frames = client.collect()
    for i in range(NUM_REQUESTS):
        *deltas, last = frames[f"r{i}"]
        assert last.finished.finish_reason == pb.FINISH_REASON_LENGTH
        assert len(joined_ids(deltas)) == MAX_TOKENS
