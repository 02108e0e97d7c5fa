"""Structured outputs and tool calling through the official openai client against a real
in-process HTTP server: response_format (json_object, json_schema and the client's
``chat.completions.parse`` with a pydantic model), vLLM's ``structured_outputs`` on
completions and chat, streamed and not; tools with tool_choice required, named, auto and
none, a second turn carrying the tool result, streamed tool calls; bad constraints are 400s."""

from __future__ import annotations

import json
import re
from typing import Literal

import jsonschema
import openai
import pytest
from http_helpers import MODEL, openai_client, post, start_http_server
from pydantic import BaseModel, Field
from tool_model import build_tool_model

from pydaemon.config.engine import EngineConfig
from pydaemon.engine.llm_engine import LLMEngine

MESSAGES = [{"role": "user", "content": "Describe a pet."}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 8},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}
CLOCK = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["UTC", "CET"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}


class Pet(BaseModel):
    name: str = Field(max_length=6)
    age: int = Field(ge=0, le=30)
    kind: Literal["cat", "dog"]


@pytest.fixture(scope="module")
def server():
    st = start_http_server()
    yield st
    st.close()


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server)


def test_parse_with_a_pydantic_model(client):
    for seed in range(3):
        completion = client.chat.completions.parse(
            model=MODEL, messages=MESSAGES, response_format=Pet, max_tokens=200, seed=seed
        )
        message = completion.choices[0].message
        assert completion.choices[0].finish_reason == "stop"
        assert isinstance(message.parsed, Pet), message.content


def test_json_object_and_json_schema_streamed(client):
    schema = Pet.model_json_schema()
    chunks = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=200,
        stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": "pet", "schema": schema}},
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    Pet.model_validate_json(text)
    r = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=300, temperature=0,
        response_format={"type": "json_object"},
    )  # fmt: skip
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)


@pytest.mark.parametrize("stream", [False, True])
def test_structured_outputs_extra_on_completions(client, stream):
    cases = [
        ({"choice": ["alpha", "beta"]}, lambda t: t in ("alpha", "beta")),
        ({"regex": "[A-Z][a-z]{2,5}"}, lambda t: re.fullmatch("[A-Z][a-z]{2,5}", t)),
        ({"grammar": 'root ::= "x" [0-9]{2}'}, lambda t: re.fullmatch("x[0-9]{2}", t)),
    ]
    for so, check in cases:
        kwargs = dict(model=MODEL, prompt="Once upon a time", max_tokens=30, n=2, seed=1)
        extra = {"structured_outputs": so}
        if stream:
            texts = ["", ""]
            for chunk in client.completions.create(stream=True, extra_body=extra, **kwargs):
                for choice in chunk.choices:
                    texts[choice.index] += choice.text
        else:
            r = client.completions.create(extra_body=extra, **kwargs)
            texts = [c.text for c in r.choices]
        assert all(check(t) for t in texts), (so, texts)


def test_structured_outputs_extra_on_chat(client):
    r = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=20,
        extra_body={"structured_outputs": {"choice": ["yes", "no"]}},
    )  # fmt: skip
    assert r.choices[0].message.content in ("yes", "no")


@pytest.mark.parametrize(
    ("body", "param", "match"),
    [
        ({"structured_outputs": {"regex": "a(b"}}, None, "invalid regex"),
        ({"structured_outputs": {"json": {"type": "objec"}}}, None, "JSON schema"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "one"),
        ({"structured_outputs": {"jsn": {}}}, "structured_outputs", "takes one of"),
        ({"response_format": {"type": "xml"}}, "response_format", "json_schema"),
        (
            {"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
            "response_format",
            "cannot be combined",
        ),
        ({"tool_choice": "required"}, "tool_choice", "needs tools"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
            "tool_choice",
            "not in tools",
        ),
    ],
)
def test_bad_constraints_are_400(server, body, param, match):
    r = post(server, "/v1/chat/completions",
             {"model": MODEL, "messages": MESSAGES, "max_tokens": 4, **body})  # fmt: skip
    assert r.status == 400, r.json()
    error = r.json()["error"]
    assert re.search(match, error["message"]), error
    if param is not None:
        assert error["param"] == param
    server.wait_all_blocks_free()


# ---- tools: a tiny random model with Qwen's chat template (it renders tools) -----------------


@pytest.fixture(scope="module")
def tool_client(tmp_path_factory):
    model_dir = build_tool_model(tmp_path_factory.mktemp("toolmodel"))
    engine = LLMEngine(EngineConfig(model=str(model_dir), device="cpu", num_kv_blocks=256))
    from conftest import make_server_thread

    st = make_server_thread(lambda: engine, http_port=0)
    yield openai_client(st), st, model_dir.name
    st.close()


def _check_call(call, tools):
    assert call.type == "function" and call.id.startswith("call_")
    tool = next(t for t in tools if t["function"]["name"] == call.function.name)
    jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])


def test_tool_choice_required_and_named(tool_client):
    client, st, model = tool_client
    tools = [WEATHER, CLOCK]
    for seed in range(3):
        r = client.chat.completions.create(
            model=model, messages=MESSAGES, tools=tools, tool_choice="required",
            max_tokens=300, seed=seed,
        )  # fmt: skip
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls", choice.message
        assert choice.message.tool_calls and choice.message.content is None
        for call in choice.message.tool_calls:
            _check_call(call, tools)
    named = {"type": "function", "function": {"name": "get_time"}}
    r = client.chat.completions.create(
        model=model, messages=MESSAGES, tools=tools, tool_choice=named, max_tokens=100, n=2
    )
    for choice in r.choices:
        [call] = choice.message.tool_calls
        assert call.function.name == "get_time"
        _check_call(call, tools)
    st.wait_all_blocks_free()


def test_streamed_tool_calls_like_openai(tool_client):
    client, _, model = tool_client
    calls: dict[int, dict] = {}
    finish = None
    for chunk in client.chat.completions.create(
        model=model, messages=MESSAGES, tools=[WEATHER], stream=True, max_tokens=100,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    ):  # fmt: skip
        choice = chunk.choices[0]
        assert not choice.delta.content
        for delta in choice.delta.tool_calls or ():
            entry = calls.setdefault(delta.index, {"arguments": ""})
            entry["id"] = delta.id or entry.get("id")
            entry["name"] = delta.function.name or entry.get("name")
            entry["arguments"] += delta.function.arguments or ""
        finish = choice.finish_reason or finish
    assert finish == "tool_calls"
    [call] = calls.values()
    assert call["name"] == "get_weather" and call["id"].startswith("call_")
    jsonschema.validate(json.loads(call["arguments"]), WEATHER["function"]["parameters"])


def test_auto_none_and_a_second_turn_with_the_tool_result(tool_client):
    client, _, model = tool_client
    r = client.chat.completions.create(
        model=model, messages=MESSAGES, tools=[WEATHER], tool_choice="auto", max_tokens=8,
        temperature=0, extra_body={"ignore_eos": True},
    )  # fmt: skip
    choice = r.choices[0]  # a random model writes no <tool_call>: plain content
    assert choice.message.tool_calls is None and choice.finish_reason == "length"
    none = client.chat.completions.create(
        model=model, messages=MESSAGES, tools=[WEATHER], tool_choice="none", max_tokens=8,
        temperature=0, extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert none.usage.prompt_tokens < r.usage.prompt_tokens  # tools not rendered
    first = client.chat.completions.create(
        model=model, messages=MESSAGES, tools=[WEATHER], tool_choice="required", max_tokens=300
    )
    call = first.choices[0].message.tool_calls[0]
    history = MESSAGES + [
        first.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": '{"temp_c": 21}'},
    ]
    second = client.chat.completions.create(
        model=model, messages=history, tools=[WEATHER], max_tokens=8, temperature=0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    # The tool call and its result are in the prompt: it is longer than the first turn's.
    assert second.usage.prompt_tokens > first.usage.prompt_tokens + 10


@pytest.mark.parametrize("stream", [False, True])
def test_a_forced_call_cut_by_max_tokens(tool_client, stream):
    """Issue 46: the partial constraint JSON came back as content; issue 55 (item 22): a cut
    call came back as a call. Now, as OpenAI and vLLM answer: no call and no content, finish
    "length", streamed or not."""
    client, st, model = tool_client
    named = {"type": "function", "function": {"name": "get_weather"}}
    r = client.chat.completions.create(
        model=model, messages=MESSAGES, tools=[WEATHER], tool_choice=named, max_tokens=3,
        stream=stream,
    )  # fmt: skip
    if stream:
        chunks = list(r)
        content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        deltas = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or ()]
        finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
    else:
        choice = r.choices[0]
        content, finish = choice.message.content, choice.finish_reason
        deltas = choice.message.tool_calls or []
    assert finish == "length" and not content and deltas == []
    st.wait_all_blocks_free()


def test_response_format_gives_way_to_a_forced_tool_call(tool_client):
    """vLLM drops response_format when tool_choice forces a call: the tool calls come back."""
    client, st, model = tool_client
    r = client.chat.completions.create(
        model=model, messages=MESSAGES, tools=[WEATHER], tool_choice="required",
        response_format={"type": "json_object"}, max_tokens=300, seed=2,
    )  # fmt: skip
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    _check_call(choice.message.tool_calls[0], [WEATHER])
    st.wait_all_blocks_free()


@pytest.mark.parametrize("stream", [False, True])
def test_a_tool_schema_error_names_tools(tool_client, stream):
    client, st, model = tool_client
    bad = {"type": "function", "function": {"name": "f", "parameters": {"type": "objec"}}}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=model, messages=MESSAGES, tools=[bad], tool_choice="required", max_tokens=4,
            stream=stream,
        )  # fmt: skip
    assert e.value.body["param"] == "tools"
    assert e.value.body["message"].startswith("tools: "), e.value.body
    st.wait_all_blocks_free()


LOCATED = {
    "type": "function",
    "function": {
        "name": "locate",
        "parameters": {
            "type": "object",
            "properties": {"place": {"$ref": "#/$defs/Place"}},
            "required": ["place"],
            "additionalProperties": False,
            "$defs": {
                "Place": {
                    "type": "object",
                    "properties": {"city": {"type": "string", "maxLength": 6}},
                    "required": ["city"],
                    "additionalProperties": False,
                }
            },
        },
    },
}


@pytest.mark.parametrize("stream", [False, True])
def test_required_with_defs_and_refs(tool_client, stream):
    """Issue 46: parameters using $defs / $ref failed with "Cannot find field '$defs'" (the
    wrapper schema moved them); pydantic models with nested models write such schemas."""
    client, st, model = tool_client
    r = client.chat.completions.create(
        model=model, messages=MESSAGES, tools=[LOCATED, WEATHER], tool_choice="required",
        max_tokens=300, seed=4, stream=stream,
    )  # fmt: skip
    if stream:
        chunks = list(r)
        calls = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or ()]
        finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
    else:
        calls, finish = r.choices[0].message.tool_calls, r.choices[0].finish_reason
    assert finish == "tool_calls" and calls
    for call in calls:
        tool = next(t for t in (LOCATED, WEATHER) if t["function"]["name"] == call.function.name)
        jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])
    st.wait_all_blocks_free()
