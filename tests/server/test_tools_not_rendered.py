"""Issue 55 item 17: tool_choice "auto" with ``--tool-call-parser hermes`` on a chat template
that leaves the tools out (the demo model's, SmolLM2's) was accepted with the tools silently
absent (prompt tokens unchanged). Now a 400 naming ``tools`` (HTTP, streamed or not) and
INVALID_ARGUMENT over gRPC, the same as a ValueError offline; "required", a named function and
"none" still work with any template. A template that renders tools serves auto
(test_http_structured.py's tool model)."""

from __future__ import annotations

import openai
import pytest
from conftest import make_server_thread, shared_demo_engine
from http_helpers import MODEL, openai_client
from server_helpers import BidiClient

from pydaemon.entrypoints.common.tool_choice import (
    ToolsNotRendered,
    encode_chat_with_tools,
    tools_must_render,
)
from pydaemon.entrypoints.grpc.servicer import ServingOptions
from pydaemon.proto.pagedd.v1 import generation_pb2 as pb

MESSAGES = [{"role": "user", "content": "Weather in Oslo?"}]
WEATHER = {
    "type": "function",
    "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {}}},
}


@pytest.fixture(scope="module")
def hermes_server():
    st = make_server_thread(
        shared_demo_engine, http_port=0, serving=ServingOptions(tool_call_parser="hermes")
    )
    yield st
    st.close()


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("tool_choice", ["auto", None])
def test_auto_on_a_template_without_tools_is_a_400_naming_tools(hermes_server, stream, tool_choice):
    client = openai_client(hermes_server)
    extra = {} if tool_choice is None else {"tool_choice": tool_choice}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=MODEL, messages=MESSAGES, tools=[WEATHER], max_tokens=4, stream=stream, **extra
        )
    assert e.value.body["param"] == "tools"
    assert "chat template does not render tools" in e.value.body["message"]
    assert "--chat-template" in e.value.body["message"]
    hermes_server.wait_all_blocks_free()


def test_forced_choices_and_none_still_work(hermes_server):
    client = openai_client(hermes_server)
    named = {"type": "function", "function": {"name": "get_weather"}}
    for choice in ("required", named):
        r = client.chat.completions.create(
            model=MODEL, messages=MESSAGES, tools=[WEATHER], max_tokens=30, tool_choice=choice
        )
        assert r.choices[0].finish_reason in ("length", "tool_calls")
    r = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=[WEATHER], max_tokens=4, tool_choice="none"
    )
    plain = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4)
    assert r.usage.prompt_tokens == plain.usage.prompt_tokens
    hermes_server.wait_all_blocks_free()


def test_grpc_auto_on_a_template_without_tools_is_invalid_argument(hermes_server):
    chat = pb.ChatMessages(
        messages=[pb.ChatMessage(role="user", content="Hi")],
        tools=[pb.Tool(name="f", parameters_json='{"type": "object"}')],
        tool_choice="auto",
    )
    client = BidiClient(hermes_server.stub())
    client.send(pb.GenerateRequest(start=pb.StartRequest(request_id="a", messages=chat)))
    [frame] = client.close_send().collect()["a"]
    assert frame.error.code == 3, frame
    assert frame.error.message.startswith("messages.tools: ")
    assert "does not render tools" in frame.error.message


def test_the_check_compares_the_prompt_with_and_without_the_tools():
    tokenizer = shared_demo_engine().tokenizer
    assert tools_must_render([WEATHER], "auto") and tools_must_render([WEATHER], None)
    assert not tools_must_render([WEATHER], "required") and not tools_must_render(None, "auto")
    with pytest.raises(ToolsNotRendered):
        encode_chat_with_tools(tokenizer, MESSAGES, True, [WEATHER], must_render_tools=True)
    text, ids = encode_chat_with_tools(
        tokenizer, MESSAGES, True, [WEATHER], must_render_tools=False
    )
    assert "get_weather" not in text and ids

    class ToolTemplate:  # a template that writes the tools: accepted
        special_token_texts = frozenset()

        def apply_chat_template(self, messages, add_generation_prompt, tools, **kwargs):
            return f"{messages[-1]['content']} tools={[t['function']['name'] for t in tools or []]}"

        def encode(self, text, add_bos=True):
            return [len(text)]

    text, _ = encode_chat_with_tools(
        ToolTemplate(), MESSAGES, True, [WEATHER], must_render_tools=True
    )
    assert text.endswith("tools=['get_weather']")
