"""Denial of service through big prompts (issue 32, finding 1): chat messages are size-checked
before rendering, and rendering and tokenizing run off the event loop, over HTTP and gRPC;
an HTTP text prompt too long to fit is refused before it is tokenized."""

from __future__ import annotations

import threading
import time

import grpc
from fake_engine import FakeEngine, FakeTokenizer
from http_helpers import post, request
from server_helpers import BidiClient

from pydaemon.entrypoints.common.limits import MAX_PROMPT_BYTES_PER_TOKEN
from pydaemon.proto.pagedd.v1 import generation_pb2 as pb

RENDER_S = 1.5


class SlowTemplateTokenizer(FakeTokenizer):
    """Renders and encodes like FakeTokenizer, but a chat takes RENDER_S (a 15 MB message)."""

    def __init__(self) -> None:
        self.num_encoded_chars = 0

    def apply_chat_template(self, messages, add_generation_prompt=True, tools=None, **kwargs):
        time.sleep(RENDER_S)
        return super().apply_chat_template(messages, add_generation_prompt, tools, **kwargs)

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        self.num_encoded_chars += len(text)
        return super().encode(text, add_bos)


def _server(start_server, max_model_len: int = 64):
    engine = FakeEngine(num_gpu_blocks=256, max_model_len=max_model_len, step_delay_s=0.002)
    engine.tokenizer = SlowTemplateTokenizer()
    return start_server(lambda: engine, http_port=0), engine


def _health_latencies(st, until: threading.Event) -> list[float]:
    latencies = []
    while not until.is_set():
        t0 = time.monotonic()
        assert request(st, "GET", "/health").status == 200
        latencies.append(time.monotonic() - t0)
        time.sleep(0.05)
    return latencies


def test_http_chat_renders_off_the_event_loop(start_server):
    st, _ = _server(start_server)
    done = threading.Event()
    result = {}

    def chat():
        body = {"model": "fake", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
        result["r"] = post(st, "/v1/chat/completions", body)
        done.set()

    threading.Thread(target=chat).start()
    time.sleep(0.1)
    latencies = _health_latencies(st, done)
    assert result["r"].status == 200, result["r"].text
    assert len(latencies) >= 5 and max(latencies) < RENDER_S / 2


def test_grpc_chat_renders_off_the_event_loop(start_server):
    st, _ = _server(start_server)
    client = BidiClient(st.stub())
    messages = pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="hi")])
    start = pb.StartRequest(
        request_id="c", messages=messages, sampling=pb.SamplingParams(max_tokens=2)
    )
    client.send(pb.GenerateRequest(start=start)).close_send()
    done = threading.Event()
    frames = {}

    def collect():
        frames.update(client.collect())
        done.set()

    threading.Thread(target=collect).start()
    time.sleep(0.1)
    latencies = _health_latencies(st, done)
    assert frames["c"][-1].finished.usage.completion_tokens == 2
    assert len(latencies) >= 5 and max(latencies) < RENDER_S / 2


def test_oversized_chat_is_refused_before_rendering(start_server):
    st, engine = _server(start_server)
    big = "x" * (64 * MAX_PROMPT_BYTES_PER_TOKEN + 1)
    t0 = time.monotonic()
    body = {"model": "fake", "messages": [{"role": "user", "content": big}]}
    r = post(st, "/v1/chat/completions", body)
    assert r.status == 400 and r.json()["error"]["param"] == "messages"
    assert "cannot fit in max_model_len 64" in r.json()["error"]["message"]
    client = BidiClient(st.stub())
    messages = pb.ChatMessages(messages=[pb.ChatMessage(role="user", content=big)])
    client.send(pb.GenerateRequest(start=pb.StartRequest(request_id="c", messages=messages)))
    (err,) = client.close_send().collect()["c"]
    assert err.error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert "cannot fit in max_model_len 64" in err.error.message
    assert time.monotonic() - t0 < RENDER_S  # never rendered
    assert engine.tokenizer.num_encoded_chars == 0


def test_oversized_http_text_prompt_is_refused_before_tokenizing(start_server):
    st, engine = _server(start_server)
    big = "x" * (64 * MAX_PROMPT_BYTES_PER_TOKEN + 1)
    r = post(st, "/v1/completions", {"model": "fake", "prompt": ["ok", big]})
    assert r.status == 400 and r.json()["error"]["param"] == "prompt.1"
    assert "cannot fit in max_model_len 64" in r.json()["error"]["message"]
    assert engine.tokenizer.num_encoded_chars == 2  # "ok" only


def _serving(**kw):
    from pydaemon.entrypoints.grpc.servicer import ServingOptions

    return ServingOptions(**kw)


def test_queue_limit_counts_sequences_prompts_times_n(start_server):
    """Finding 2: a batch of prompts with n > 1 counts as prompts x n sequences."""
    engine = FakeEngine(num_gpu_blocks=4096, max_model_len=64, step_delay_s=0.002)
    st = start_server(lambda: engine, http_port=0, serving=_serving(max_queued_requests=8))
    body = {"model": "fake", "max_tokens": 2, "n": 2, "temperature": 1.0}
    ok = post(st, "/v1/completions", {**body, "prompt": [[5]] * 4})  # 8 sequences
    assert ok.status == 200, ok.text
    r = post(st, "/v1/completions", {**body, "prompt": [[5]] * 5})  # 10 sequences
    assert r.status == 429 and r.json()["error"]["code"] == "queue_full"
    assert "adds 10" in r.json()["error"]["message"]
    chat = {"model": "fake", "max_tokens": 2, "n": 9, "temperature": 1.0}
    r = post(st, "/v1/chat/completions", {**chat, "messages": [{"role": "user", "content": "x"}]})
    assert r.status == 429
    client = BidiClient(st.stub())
    sampling = pb.SamplingParams(max_tokens=2, n=3, best_of=9, temperature=1.0)
    client.start("g", [5], sampling=sampling).close_send()
    (err,) = client.collect()["g"]
    assert err.error.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
    assert st.wait_all_blocks_free().num_free_gpu_blocks == 4096
