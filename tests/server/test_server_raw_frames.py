"""Frames that cannot be decoded end the call with INVALID_ARGUMENT naming the problem
(they used to be taken for a half-close: the call ended OK and later frames were dropped)."""

from __future__ import annotations

import grpc
import pytest
from server_helpers import raw_generate

from pydaemon.proto.pagedd.v1 import generation_pb2 as pb

BAD_UTF8_REQUEST_ID = b"\x0a\x04" + b"\x0a\x02\xff\xfe"  # start { request_id: <invalid UTF-8> }
GARBAGE = b"\xff\xff\xff\xff"


def _start(request_id: str, max_tokens: int = 3) -> bytes:
    return pb.GenerateRequest(
        start=pb.StartRequest(
            request_id=request_id,
            token_ids=pb.TokenIds(ids=[5, 6, 7]),
            sampling=pb.SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True),
        )
    ).SerializeToString()


@pytest.fixture(scope="module")
def server():
    from conftest import make_server_thread, shared_demo_engine

    st = make_server_thread(shared_demo_engine)
    yield st
    st.close()


@pytest.mark.parametrize(
    "bad, words", [(BAD_UTF8_REQUEST_ID, "UTF-8"), (GARBAGE, "could not be decoded")]
)
def test_undecodable_frame_ends_the_call_with_invalid_argument(server, bad, words):
    frames = [_start("long", max_tokens=400), bad, _start("later")]
    with pytest.raises(grpc.RpcError) as e:
        raw_generate(server.channel, frames)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert words in e.value.details(), e.value.details()
    stats = server.wait_all_blocks_free()  # the live request was aborted with the stream
    assert stats.num_free_gpu_blocks == stats.num_gpu_blocks


def test_valid_raw_frames_still_work(server):
    server.stub()
    replies = [
        pb.GenerateResponse.FromString(b) for b in raw_generate(server.channel, [_start("a")])
    ]
    assert replies[-1].HasField("finished")
    assert replies[-1].finished.usage.completion_tokens == 3
