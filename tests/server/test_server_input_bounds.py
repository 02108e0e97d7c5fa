"""Big inputs are refused early with a clear error, and Tokenize runs off the event loop
(a 14 MB Tokenize used to stall every stream for a minute)."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from fake_engine import FakeEngine, FakeTokenizer
from server_helpers import BidiClient, raw_generate

from pydaemon.entrypoints.common.limits import MAX_PROMPT_BYTES_PER_TOKEN
from pydaemon.proto.pagedd.v1 import generation_pb2 as pb


class BlockingTokenizer(FakeTokenizer):
    """encode waits until released; counts its calls."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.num_encodes = 0

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        self.num_encodes += 1
        assert self.release.wait(30)
        return super().encode(text, add_bos)


def _engine_with(tokenizer, max_model_len: int = 64) -> FakeEngine:
    engine = FakeEngine(num_gpu_blocks=256, max_model_len=max_model_len)
    engine.tokenizer = tokenizer
    return engine


def test_tokenize_does_not_block_the_event_loop(start_server):
    tokenizer = BlockingTokenizer()
    engine = _engine_with(tokenizer)
    st = start_server(lambda: engine)
    stub = st.stub()
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(
            stub.Tokenize, pb.TokenizeRequest(text="abc", add_bos=True), timeout=30
        )
        try:
            while tokenizer.num_encodes == 0:
                threading.Event().wait(0.01)
            # The loop must still answer while the tokenizer is busy.
            info = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=5)
            assert info.model_name == "fake"
        finally:
            tokenizer.release.set()
        assert len(pending.result().token_ids) == 4


def test_oversized_text_refused_before_tokenizing(start_server):
    tokenizer = BlockingTokenizer()
    tokenizer.release.set()
    st = start_server(lambda: _engine_with(tokenizer, max_model_len=64))
    too_long = "x" * (64 * MAX_PROMPT_BYTES_PER_TOKEN + 1)
    client = BidiClient(st.stub())
    client.start("r", too_long, sampling=pb.SamplingParams(max_tokens=2)).close_send()
    (frame,) = client.collect()["r"]
    assert frame.error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert "cannot fit in max_model_len 64" in frame.error.message
    with pytest.raises(grpc.RpcError) as e:
        st.stub().Tokenize(pb.TokenizeRequest(text=too_long), timeout=10)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "Tokenize text" in e.value.details()
    # multi-byte characters count in bytes
    client = BidiClient(st.stub())
    client.start("u", "é" * (32 * MAX_PROMPT_BYTES_PER_TOKEN + 1)).close_send()
    assert "bytes" in client.collect()["u"][0].error.message
    assert tokenizer.num_encodes == 0


@pytest.mark.parametrize(
    "sampling, words",
    [
        (pb.SamplingParams(stop=["s" * 5000]), "at most 1024"),
        (pb.SamplingParams(stop_token_ids=[3] * 5000), "stop_token_ids has 5000 ids"),
    ],
)
def test_stop_sizes_bounded(start_server, sampling, words):
    st = start_server()
    client = BidiClient(st.stub())
    client.start("r", [5, 6], sampling=sampling).close_send()
    (frame,) = client.collect()["r"]
    assert frame.error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert words in frame.error.message


def test_too_many_prompt_ids_named_before_the_engine(start_server):
    engine = FakeEngine(num_gpu_blocks=256, max_model_len=64)
    reached: list[str] = []
    add_request = engine.add_request
    engine.add_request = lambda request, *a, **kw: (
        reached.append(request.request_id),
        add_request(request, *a, **kw),
    )
    st = start_server(lambda: engine)
    client = BidiClient(st.stub())
    client.start("r", [5] * 65).close_send()
    (frame,) = client.collect()["r"]
    assert (
        "prompt token_ids has 65 tokens, longer than the context (max_model_len 64)"
        in frame.error.message
    )
    assert reached == []


def test_frame_over_max_message_bytes_is_resource_exhausted(start_server):
    st = start_server(max_message_bytes=64 * 1024)
    big = pb.GenerateRequest(
        start=pb.StartRequest(request_id="r", text="x" * (128 * 1024))
    ).SerializeToString()
    with pytest.raises(grpc.RpcError) as e:
        raw_generate(st.channel, [big], timeout=10)
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    client = BidiClient(st.stub())  # the server still serves
    client.start("ok", [5, 6], sampling=pb.SamplingParams(max_tokens=2)).close_send()
    assert client.collect()["ok"][-1].HasField("finished")
