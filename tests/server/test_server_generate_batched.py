"""GenerateBatched: the same frames as Generate, packed per engine step, same errors."""

from __future__ import annotations

import grpc
import pytest
from server_helpers import BidiClient, joined_ids, joined_text

from pydaemon.proto.pagedd.v1 import generation_pb2 as pb

PROMPTS = ("Hello, my name is", "The capital of France is", "1 2 3 4 5", "Once upon a time")
MAX_TOKENS = (12, 20, 7, 16)


def _run_all(server, batched: bool) -> tuple[dict, BidiClient]:
    client = BidiClient(server.stub(), batched=batched)
    for i, (prompt, max_tokens) in enumerate(zip(PROMPTS, MAX_TOKENS, strict=True)):
        sampling = pb.SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        client.start(f"r{i}", prompt, sampling=sampling)
    client.close_send()
    return client.collect(), client


def test_batched_frames_equal_the_unbatched_ones(demo_server):
    server = demo_server()
    plain, _ = _run_all(server, batched=False)
    packed, client = _run_all(server, batched=True)
    assert sorted(packed) == sorted(plain)
    for request_id, frames in plain.items():
        got = packed[request_id]
        assert joined_ids(got) == joined_ids(frames)
        assert joined_text(got) == joined_text(frames)
        assert got[-1].HasField("finished")
        assert got[-1].finished.usage.completion_tokens == len(joined_ids(frames))
    # Four requests decode in the same steps: their frames share messages.
    assert max(client.batch_sizes) >= 2, client.batch_sizes
    assert sum(client.batch_sizes) == sum(len(f) for f in packed.values())
    assert server.wait_all_blocks_free().num_free_gpu_blocks == server.stats().num_gpu_blocks


def test_a_bad_request_fails_alone_in_band(demo_server):
    server = demo_server()
    client = BidiClient(server.stub(), batched=True)
    client.start("good", "Hello", sampling=pb.SamplingParams(max_tokens=4, ignore_eos=True))
    client.start("bad", "Hello", sampling=pb.SamplingParams(temperature=-1.0))
    client.close_send()
    frames = client.collect()
    assert frames["bad"][-1].error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert "temperature" in frames["bad"][-1].error.message
    assert len(joined_ids(frames["good"])) == 4


def test_cancel_frees_blocks_and_a_duplicate_id_ends_the_call(demo_server):
    server = demo_server()
    client = BidiClient(server.stub(), batched=True)
    client.start("long", "Hello", sampling=pb.SamplingParams(max_tokens=500, ignore_eos=True))
    first = client.next()
    assert first.request_id == "long" and first.HasField("delta")
    client.cancel("long")
    while not (frame := client.next()).HasField("finished"):
        pass
    assert frame.finished.finish_reason == pb.FINISH_REASON_CANCELLED
    stats = server.wait_all_blocks_free()
    assert stats.num_free_gpu_blocks == stats.num_gpu_blocks
    client.start("dup", "Hello", sampling=pb.SamplingParams(max_tokens=500, ignore_eos=True))
    client.start("dup", "Hello")
    with pytest.raises(grpc.RpcError) as err:
        client.collect()
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "already live" in err.value.details()
    stats = server.wait_all_blocks_free()
    assert stats.num_free_gpu_blocks == stats.num_gpu_blocks
