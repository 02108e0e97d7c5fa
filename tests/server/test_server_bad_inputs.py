"""A table of bad inputs: each gets its status (malformed stream) or in-band error (bad
request), and the server is healthy and serving afterwards."""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from server_helpers import BidiClient

from pydaemon.proto.pagedd.v1 import generation_pb2 as pb

INVALID = grpc.StatusCode.INVALID_ARGUMENT
SP = pb.SamplingParams


def start(request_id="r", prompt=(5, 6), **kw) -> pb.GenerateRequest:
    s = pb.StartRequest(request_id=request_id, **kw)
    if isinstance(prompt, str):
        s.text = prompt
    elif prompt is not None:
        s.token_ids.ids.extend(prompt)
    return pb.GenerateRequest(start=s)


# (name, frames, expected): expected is ("status", code) for a call that must end with that
# status, or ("error", code, words) for an in-band RequestError naming what is wrong.
CASES = [
    ("frame without action", [pb.GenerateRequest()], ("status", INVALID)),
    ("empty request_id", [start(request_id="")], ("status", INVALID)),
    ("request_id too long", [start(request_id="x" * 300)], ("status", INVALID)),
    ("cancel with empty id", [pb.GenerateRequest(cancel=pb.CancelRequest())], ("status", INVALID)),
    (
        "duplicate live request_id",
        [start(sampling=SP(max_tokens=400, ignore_eos=True)), start()],
        ("status", INVALID),
    ),
    ("no prompt", [start(prompt=None)], ("error", INVALID, "prompt is not set")),
    ("empty text prompt", [start(prompt="")], ("error", INVALID, "prompt")),
    ("empty token_ids", [start(prompt=[])], ("error", INVALID, "token_ids is empty")),
    ("token id outside vocab", [start(prompt=[5, 10_000])], ("error", INVALID, "vocabulary")),
    ("prompt longer than max_model_len", [start(prompt=[5] * 5000)], ("error", INVALID, "")),
    ("temperature < 0", [start(sampling=SP(temperature=-0.5))], ("error", INVALID, "temperature")),
    (
        "temperature too large",
        [start(sampling=SP(temperature=1e6))],
        ("error", INVALID, "temperature"),
    ),
    (
        "temperature NaN",
        [start(sampling=SP(temperature=float("nan")))],
        ("error", INVALID, "temperature"),
    ),
    ("top_p = 0", [start(sampling=SP(top_p=0.0))], ("error", INVALID, "top_p")),
    ("top_p > 1", [start(sampling=SP(top_p=1.5))], ("error", INVALID, "top_p")),
    ("top_k = -2", [start(sampling=SP(top_k=-2))], ("error", INVALID, "top_k")),
    ("min_p > 1", [start(sampling=SP(min_p=2.0))], ("error", INVALID, "min_p")),
    ("n = 0", [start(sampling=SP(n=0))], ("error", INVALID, "n ")),
    ("n too large", [start(sampling=SP(n=100_000))], ("error", INVALID, "n ")),
    ("max_tokens = 0", [start(sampling=SP(max_tokens=0))], ("error", INVALID, "max_tokens")),
    (
        "min_tokens > max_tokens",
        [start(sampling=SP(max_tokens=2, min_tokens=5))],
        ("error", INVALID, "min_tokens"),
    ),
    ("logprobs too many", [start(sampling=SP(logprobs=1000))], ("error", INVALID, "logprobs")),
    (
        "presence_penalty out of range",
        [start(sampling=SP(presence_penalty=5.0))],
        ("error", INVALID, "presence_penalty"),
    ),
    (
        "repetition_penalty = 0",
        [start(sampling=SP(repetition_penalty=0.0))],
        ("error", INVALID, "repetition_penalty"),
    ),
    ("empty stop string", [start(sampling=SP(stop=[""]))], ("error", INVALID, "stop")),
    (
        "stop token outside vocab",
        [start(sampling=SP(stop_token_ids=[99_999]))],
        ("error", INVALID, "stop_token_ids"),
    ),
    (
        "best_of < n",
        [start(sampling=SP(n=3, best_of=2, temperature=1.0))],
        ("error", INVALID, "best_of"),
    ),
    (
        "beam search with sampling",
        [start(sampling=SP(beam_width=2, temperature=1.0))],
        ("error", INVALID, "temperature"),
    ),
    ("cache_salt too long", [start(cache_salt="s" * 1000)], ("error", INVALID, "cache_salt")),
    *(
        (
            f"beam length_penalty {lp}",
            [start(sampling=SP(beam_width=2, temperature=0, length_penalty=lp))],
            ("error", INVALID, "length_penalty"),
        )
        for lp in (1e10, 200.0, float("nan"), float("inf"), float("-inf"))
    ),
]


@pytest.fixture(scope="module")
def server():
    from conftest import make_server_thread, shared_demo_engine

    st = make_server_thread(shared_demo_engine)
    yield st
    st.close()


@pytest.mark.parametrize("name,frames,expected", CASES, ids=[c[0] for c in CASES])
def test_bad_input(server, name, frames, expected):
    client = BidiClient(server.stub(), timeout=30)
    for frame in frames:
        client.send(frame)
    client.close_send()
    if expected[0] == "status":
        with pytest.raises(grpc.RpcError) as e:
            client.collect()
        assert e.value.code() == expected[1], e.value.details()
        assert e.value.details()
    else:
        _, code, words = expected
        frames_by_id = client.collect()
        (frame,) = frames_by_id["r"]
        assert frame.HasField("error"), frame
        assert frame.error.code == code.value[0], frame.error
        assert words in frame.error.message, frame.error.message


def test_healthy_and_serving_after_the_bad_inputs(server):
    assert len(CASES) >= 20
    health = health_pb2_grpc.HealthStub(server.channel)
    assert (
        health.Check(health_pb2.HealthCheckRequest()).status
        == health_pb2.HealthCheckResponse.SERVING
    )
    client = BidiClient(server.stub())
    sampling = pb.SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    client.start("ok", [5, 6], sampling=sampling).close_send()
    assert client.collect()["ok"][-1].finished.usage.completion_tokens == 3
    stats = server.wait_all_blocks_free()
    assert stats.num_free_gpu_blocks == stats.num_gpu_blocks
