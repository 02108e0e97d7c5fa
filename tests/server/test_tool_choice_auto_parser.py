"""tool_choice "auto" (or tools without a tool_choice, which means auto) needs a tool-call
parser: vLLM's rule. The demo model's chat template has no tool syntax, so it rendered the
same prompt with or without the tools and the tools were silently ignored (issue 46); now a
400 (HTTP, streamed or not) / INVALID_ARGUMENT (gRPC) naming --tool-call-parser, and
--tool-call-parser makes it work on a template that renders the tools
(test_tools_not_rendered.py: a template that leaves them out is refused too)."""

from __future__ import annotations

import openai
import pytest
from conftest import make_server_thread, shared_demo_engine
from http_helpers import MODEL, openai_client
from server_helpers import BidiClient

from pydaemon.proto.pagedd.v1 import generation_pb2 as pb

MESSAGES = [{"role": "user", "content": "Weather in Oslo?"}]
WEATHER = {
    "type": "function",
    "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {}}},
}


@pytest.fixture(scope="module")
def server():
    st = make_server_thread(shared_demo_engine, http_port=0)
    yield st
    st.close()


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("tool_choice", ["auto", None])
def test_auto_without_a_parser_is_a_400(server, stream, tool_choice):
    client = openai_client(server)
    extra = {} if tool_choice is None else {"tool_choice": tool_choice}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=MODEL, messages=MESSAGES, tools=[WEATHER], max_tokens=4, stream=stream, **extra
        )
    assert e.value.body["param"] == "tool_choice"
    assert '"auto" tool choice requires --tool-call-parser' in e.value.body["message"]
    # required, a named function and none need no parser
    for choice in ("required", "none"):
        r = client.chat.completions.create(
            model=MODEL, messages=MESSAGES, tools=[WEATHER], max_tokens=4, tool_choice=choice
        )
        assert r.choices[0].finish_reason in ("length", "stop", "tool_calls")
    server.wait_all_blocks_free()


def test_grpc_auto_without_a_parser_is_invalid_argument(server):
    chat = pb.ChatMessages(
        messages=[pb.ChatMessage(role="user", content="Hi")],
        tools=[pb.Tool(name="f", parameters_json='{"type": "object"}')],
    )
    client = BidiClient(server.stub())
    client.send(pb.GenerateRequest(start=pb.StartRequest(request_id="a", messages=chat)))
    [frame] = client.close_send().collect()["a"]
    assert frame.error.code == 3 and "--tool-call-parser" in frame.error.message, frame
