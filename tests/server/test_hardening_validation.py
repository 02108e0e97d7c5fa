"""Errors that were 500 / UNKNOWN or silently wrong (issue 32, finding 6): each is now a clear
400 / INVALID_ARGUMENT naming the field, with one set of limits for HTTP and gRPC."""

from __future__ import annotations

import json

import grpc
import pytest
from fake_engine import FakeEngine
from http_helpers import post
from server_helpers import BidiClient

from pydaemon.entrypoints.common.limits import MAX_STOP_STRING_CHARS, MAX_STOP_TOKEN_IDS
from pydaemon.proto.pagedd.v1 import generation_pb2 as pb

CHAT = {"model": "fake", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
COMPLETION = {"model": "fake", "max_tokens": 2, "prompt": [5, 6]}


@pytest.fixture
def st(start_server):
    engine = FakeEngine(num_gpu_blocks=256)
    return start_server(lambda: engine, http_port=0)


def _param_of_400(r) -> str | None:
    assert r.status == 400, r.text
    return r.json()["error"]["param"]


@pytest.mark.parametrize("key", ["messages", "add_generation_prompt", "documents", "template"])
def test_reserved_chat_template_kwargs_are_400(st, key):
    r = post(st, "/v1/chat/completions", {**CHAT, "chat_template_kwargs": {key: 1}})
    assert r.status == 400 and "chat_template_kwargs may not set" in r.text


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"seed": 2**64}, "seed"),
        ({"stop": ["x"] * 17}, "stop"),
        ({"stop": ["x" * (MAX_STOP_STRING_CHARS + 1)]}, "stop"),
        ({"stop_token_ids": [1] * (MAX_STOP_TOKEN_IDS + 1)}, "stop_token_ids"),
        ({"stop_token_ids": [10**9]}, "stop_token_ids"),
        ({"stream": "yes"}, "stream"),
        ({"prompt": [True, False]}, "prompt.list[int].0"),
    ],
)
def test_http_limits_match_grpc(st, extra, param):
    param_of = _param_of_400(post(st, "/v1/completions", {**COMPLETION, **extra}))
    assert param_of is not None and param_of.startswith(param.split(".")[0])


def test_grpc_refuses_the_same_stop_token_id(st):
    client = BidiClient(st.stub())
    client.start("a", [5], sampling=pb.SamplingParams(stop_token_ids=[10**9])).close_send()
    (err,) = client.collect()["a"]
    assert err.error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert "stop_token_ids" in err.error.message


def test_tools_are_honoured_not_silently_ignored(start_server):
    """Tool calls are parsed now (issue 28): tools with tool_choice unset or auto are served,
    and the reply says whether the model called one (tool_calls, finish_reason). Auto needs a
    tool-call parser (issue 46: tests/server/test_tool_choice_auto_parser.py) and a template
    that renders the tools (issue 55: tests/server/test_tools_not_rendered.py)."""
    from pydaemon.entrypoints.grpc.servicer import ServingOptions

    engine = FakeEngine(num_gpu_blocks=256)
    template = (
        "{% for t in tools or [] %}<tool>{{ t.function.name }}</tool>{% endfor %}"
        "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}<a>"
    )
    st = start_server(
        lambda: engine,
        http_port=0,
        serving=ServingOptions(tool_call_parser="hermes"),
        chat_template=template,
    )
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    for choice in ({}, {"tool_choice": "auto"}, {"tool_choice": "none"}):
        r = post(st, "/v1/chat/completions", {**CHAT, "tools": tools, **choice})
        assert r.status == 200, r.text
        choice0 = json.loads(r.text)["choices"][0]
        assert "tool_calls" in choice0["message"]
        assert choice0["finish_reason"] in ("length", "stop", "tool_calls")


def test_a_body_that_is_not_json_is_415(st):
    r = post(
        st, "/v1/completions", b'{"model": "fake", "prompt": [5]}', {"Content-Type": "text/plain"}
    )
    assert r.status == 415


@pytest.mark.parametrize("method", ["Tokenize", "GetModelInfo"])
def test_undecodable_unary_request_is_invalid_argument(st, method):
    with grpc.insecure_channel(st.address) as channel:
        call = channel.unary_unary(f"/pagedd.v1.Generation/{method}")
        with pytest.raises(grpc.RpcError) as e:
            call(b"\x0a\x02\xff\xfe" if method == "Tokenize" else b"\xff", timeout=10)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_completions_logprobs_20_has_20_alternatives(demo_server):
    st = demo_server(http_port=0)
    body = {"model": "demo", "prompt": "Once upon a time", "max_tokens": 4, "logprobs": 20}
    r = post(st, "/v1/completions", body)
    assert r.status == 200, r.text
    for top in r.json()["choices"][0]["logprobs"]["top_logprobs"]:
        assert len(top) >= 20


def test_kv_overrun_abort_says_why(start_server):
    from pydaemon.config.engine import EngineConfig
    from pydaemon.engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineConfig(model="demo", device="cpu", num_kv_blocks=2, block_size=8))
    st = start_server(lambda: engine)
    client = BidiClient(st.stub())
    sampling = pb.SamplingParams(max_tokens=64, ignore_eos=True)
    client.start("a", [5, 6, 7], sampling=sampling).close_send()
    last = client.collect()["a"][-1]
    assert last.finished.finish_reason == pb.FINISH_REASON_ABORTED
    assert "needs more KV blocks than the cache has" in last.finished.abort_reason
